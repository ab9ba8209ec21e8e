"""How the grader's report names the folder it graded."""

from zerolab.grading.report import shown_path


def test_the_graded_folder_is_shown_without_this_machines_path(tmp_path, monkeypatch):
    """A notebook (cwd notebooks/) shows ../exercises: stored outputs name no machine's path."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "exercises" / "sub").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "notebooks")
    assert shown_path(tmp_path / "exercises") == "../exercises"
    monkeypatch.chdir(tmp_path)
    assert shown_path(tmp_path / "exercises" / "sub") == "exercises/sub"
    elsewhere = tmp_path.parent.parent / "elsewhere"  # neither below nor beside
    assert shown_path(elsewhere) == str(elsewhere)
