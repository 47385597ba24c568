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
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value)


def test_bad_toml_file_is_a_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[trainer\nlr = 1")
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(path)


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["trainer.lr"])
