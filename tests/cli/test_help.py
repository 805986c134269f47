"""What the sub-commands' help says names real recipe keys."""

import pytest

from rltt.cli.main import main


def test_pretrain_help_names_the_run_directory_key(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["pretrain", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "OUTPUT_DIR" not in text and "logging.run_dir" in text
