"""The heavy-suite records (#23): a heavy suite is skipped only where every file it imported is byte-identical."""

from __future__ import annotations

import json

import pytest

from tests.support import suite_records as R


@pytest.fixture
def records(tmp_path, monkeypatch):
    if R._root() is None:
        pytest.skip("megatron-core is not installed")
    monkeypatch.setenv(R.ENV, str(tmp_path))
    return tmp_path


def test_a_record_of_identical_files_is_found_and_one_changed_byte_is_not(records):
    import megatron.core.transformer.multi_token_prediction  # noqa: F401 - some imported files to record

    R.log_imports()
    files = R.write_record("0.0.1")
    assert files > 10 and not list((records / "imports").glob("*.json"))
    assert R.earlier_identical("0.0.2") == ("0.0.1", files)
    assert R.earlier_identical("0.0.1") is None  # a release never skips on its own record
    record = json.loads((records / "0.0.1.json").read_text())
    name = next(f for f in record["files"] if f.endswith("multi_token_prediction.py"))
    record["files"][name] = "0" * 64  # as if that one file differed
    (records / "0.0.1.json").write_text(json.dumps(record))
    assert R.earlier_identical("0.0.2") is None


def test_package_info_is_compared_without_its_version_lines(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 0\nPRE_RELEASE = ''\nNAME = 'megatron'\n")
    (b / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nPRE_RELEASE = \"\"\nNAME = 'megatron'\n")
    assert R.digest(a / "package_info.py") == R.digest(b / "package_info.py")
    (b / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 1\nNAME = 'megatron-core'\n")
    assert R.digest(a / "package_info.py") != R.digest(b / "package_info.py")
    (a / "other.py").write_text("PATCH = 0\n")
    (b / "other.py").write_text("PATCH = 1\n")
    assert R.digest(a / "other.py") != R.digest(b / "other.py")  # only package_info.py is normalised


def test_a_changed_project_file_or_another_package_version_means_no_match(records, monkeypatch):
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    import gdn_compat  # noqa: F401 - a project file to record

    R.log_imports()
    R.write_record("0.0.1")
    assert R.earlier_identical("0.0.2") is not None
    record = json.loads((records / "0.0.1.json").read_text())
    assert any(f.startswith("gdn_compat/") for f in record["project"]) and "torch" in record["dists"]
    changed = dict(record, project={**record["project"], "gdn_compat/__init__.py": "0" * 64})
    (records / "0.0.1.json").write_text(json.dumps(changed))
    assert R.earlier_identical("0.0.2") is None  # gdn_compat changed since that session
    other = dict(record, dists={**record["dists"], "numpy": "0.0.0"})
    (records / "0.0.1.json").write_text(json.dumps(other))
    assert R.earlier_identical("0.0.2") is None  # another numpy in that session's venv
