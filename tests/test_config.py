import pytest

from echo.config import ConfigError, EchoConfig, load_config


def test_defaults_validate_and_round_trip_through_toml(tmp_path):
    cfg = EchoConfig()
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg


def test_overrides_are_typed():
    cfg = load_config(None, ["trainer.lr=3e-4", "run.mode=sequential", 'model.name="smollm2"', "lora.target_modules=['q_proj']"])
    assert cfg.trainer.lr == 3e-4
    assert cfg.run.mode == "sequential"
    assert cfg.model.name == "smollm2"
    assert cfg.lora.target_modules == ["q_proj"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["trainer.lrr=1"], "trainer.lrr: unknown field"),
        (["nonsense.x=1"], "nonsense: unknown field"),
        (["trainer.lr=-1"], "trainer.lr: Input should be greater than 0"),
        (["run.mode=fast"], "run.mode"),
        (["sampling.group_size=1"], "sampling.group_size"),
        (["run.id=has space"], "run.id"),
        (["run.steps=many"], "run.steps"),
        (["nats.rollouts_max_gb=4"], "nats.sampler_quota_gb"),  # the default quota, 4 GB: more than half
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value)


def test_bad_toml_file_is_a_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML .*; a YAML config ends in .yaml or .yml"):
        load_config(path)
    (tmp_path / "bad.yaml").write_text("run:\n  steps: [")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- run")
    with pytest.raises(ConfigError, match="its top level must be sections"):
        load_config(tmp_path / "list.yaml")


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainer.lr"])


def test_the_config_reference_is_current_and_explains_every_key():
    from pathlib import Path

    from echo.config_reference import reference

    text = reference()
    assert (Path(__file__).parent.parent / "docs" / "config.md").read_text() == text, (
        "docs/config.md is behind echo/config.py: .venv/bin/python -m echo.config_reference > docs/config.md")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(f.annotation.model_fields) for f in EchoConfig.model_fields.values())
    assert not [row for row in rows if row.endswith("|  |")], "a key without a meaning: comment it in echo/config.py"
