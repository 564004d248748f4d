"""`trainlab validate` checks the mix's sources against the prepared dataset when
it exists (manifest.json only: still instant), and not before one is prepared."""

from __future__ import annotations

from click.testing import CliRunner

from tests.train_helpers import dataset_dir, tiny_config
from trainlab.cli import cli
from trainlab.config import to_yaml


def validate(*args: str):
    return CliRunner().invoke(cli, ["validate", *args], standalone_mode=False)


def test_validate_refuses_a_mix_source_the_dataset_lacks(tmp_path_factory, tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(to_yaml(tiny_config(dataset_dir(tmp_path_factory))))
    assert validate(str(config)).return_value == 0
    result = validate(str(config), "--set", "data.mix.cod=0.5")
    assert result.exception is not None
    assert result.exception.lines == [
        "data.mix.cod: no source 'cod' in the prepared dataset (sources: code, docs, tiny)"
    ]


def test_validate_without_a_prepared_dataset_checks_the_config_only(tmp_path):
    config = tmp_path / "exp.yaml"
    config.write_text(to_yaml(tiny_config(tmp_path / "not-prepared")))
    result = validate(str(config), "--set", "data.mix.cod=0.5")
    assert result.exception is None and result.return_value == 0
