"""`impl:` references: relative .py paths resolve against the graph's folder (never the working
directory first), and whatever the imported file's top-level code raises, SystemExit included,
is an ImportSpecError."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.core.imports import ImportSpecError, load_object

ROOT = Path(__file__).resolve().parents[1]


def _write_op(path: Path, value: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"WHICH = {value!r}\n")
    return path


def test_relative_path_resolves_against_the_graph_folder_not_the_cwd(tmp_path, monkeypatch):
    graph_dir, cwd = tmp_path / "graph", tmp_path / "elsewhere"
    _write_op(graph_dir / "ops" / "mine.py", "graph folder")
    _write_op(cwd / "ops" / "mine.py", "working directory")  # same relative path: must not win
    monkeypatch.chdir(cwd)
    assert load_object("ops/mine.py:WHICH", base_dir=graph_dir) == "graph folder"


def test_a_file_only_in_the_cwd_is_not_found_and_the_error_says_where_it_looked(tmp_path, monkeypatch):
    graph_dir, cwd = tmp_path / "graph", tmp_path / "elsewhere"
    graph_dir.mkdir()
    _write_op(cwd / "only_here.py", "working directory")
    monkeypatch.chdir(cwd)
    with pytest.raises(ImportSpecError, match=rf"file {graph_dir / 'only_here.py'} does not exist"):
        load_object("only_here.py:WHICH", base_dir=graph_dir)


@pytest.mark.parametrize("top_level, match", [
    ("import sys\nsys.exit(3)\n", r"its top-level code called sys.exit\(3\) \(importing runs it\)"),
    ("raise SystemExit\n", r"called sys.exit\(None\)"),
    ("raise ValueError('boom')\n", r"failed: ValueError\('boom'\)"),
])
def test_anything_raised_at_import_is_an_import_spec_error(tmp_path, top_level, match):
    (tmp_path / "op.py").write_text(top_level)
    with pytest.raises(ImportSpecError, match=match):
        load_object("op.py:Op", base_dir=tmp_path)


def test_module_reference_that_exits_is_an_import_spec_error(tmp_path, monkeypatch):
    (tmp_path / "exiting_pkg_mod.py").write_text("raise SystemExit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportSpecError, match=r"cannot import module 'exiting_pkg_mod': .*sys.exit\(4\)"):
        load_object("exiting_pkg_mod:Op")


def test_validate_reports_an_impl_that_exits_instead_of_exiting_silently(capsys, monkeypatch):
    # in this process (the module's entry point has its subprocess test in tests/test_edits.py):
    # the operator file's SystemExit(3) would leave cli.main as it left the process
    from dapo_flow import cli

    monkeypatch.chdir(ROOT)
    graph = ROOT / "tests" / "graphs_bad" / "bad_custom_impl_exits.yaml"
    code = cli.main(["validate", str(graph)])
    err = capsys.readouterr().err
    assert code == 2  # it was 3, the operator file's own exit code, with no message
    assert "called sys.exit(3)" in err and "Traceback" not in err
