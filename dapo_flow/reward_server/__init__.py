"""Rewards as a service: `dapo-flow serve-reward REF` serves any reward function over HTTP
(:mod:`.server`), and a `score` node with ``reward: http://HOST:PORT`` scores on it
(:mod:`.client`); the wire format both speak is :mod:`.protocol`."""
