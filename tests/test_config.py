import tomllib

import pytest

from echo.config import ConfigError, EchoConfig, load_config, validate_config


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
        (["nonsense.x=1"], "nonsense.x: unknown field"),  # an unknown section: its keys named whole
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

    from echo.config.reference import reference

    text = reference()
    assert (Path(__file__).parent.parent / "docs" / "config.md").read_text() == text, (
        "docs/config.md is behind echo/config/__init__.py: .venv/bin/python -m echo.config.reference > docs/config.md")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == sum(len(f.annotation.model_fields) for f in EchoConfig.model_fields.values())
    assert not [row for row in rows if row.endswith("|  |")], "a key without a meaning: comment it in echo/config/__init__.py"


def test_a_preset_sets_its_fields_and_a_field_beside_it_wins():
    from echo.config import PRESETS

    assert validate_config({}).algorithm.model_dump(include=set(PRESETS["default"])) == PRESETS["default"]
    for name, fields in PRESETS.items():
        assert validate_config({"algorithm": {"preset": name}}).algorithm.model_dump(include=set(fields)) == fields
    dapo = load_config(None, ["algorithm.preset=dapo", "algorithm.clip_high=0.3"]).algorithm
    assert (dapo.clip_high, dapo.clip_low, dapo.dynamic_sampling, dapo.mask_truncated) == (0.3, 0.2, True, True)
    again = validate_config(tomllib.loads(validate_config({"algorithm": {"preset": "gspo"}}).to_toml()))
    assert again.algorithm == validate_config({"algorithm": {"preset": "gspo"}}).algorithm  # a run's config.toml


@pytest.mark.parametrize("fields, named", [
    ({"num_iterations": 4, "rollout_is": "off"}, "algorithm.num_iterations"),
    ({"preset": "gspo", "loss_aggregation": "token_mean"}, "algorithm.ratio_level"),
    ({"rollout_rs": "token", "rollout_rs_threshold": 2.0, "rollout_rs_threshold_lower": 3.0},
     "algorithm.rollout_rs_threshold_lower"),
    ({"preset": "ppo"}, "algorithm.preset"),
    ({"clip_low": 1.0}, "algorithm.clip_low"),
])
def test_a_wrong_combination_fails_at_start_naming_the_field(fields, named):
    with pytest.raises(ConfigError, match=named):
        validate_config({"algorithm": fields})
    assert validate_config({"algorithm": {"num_iterations": 4, "rollout_is": "off", "rollout_rs": "token"}})


def test_an_earlier_releases_objective_keys_still_load():
    """trainer.clip_eps, kl_coef, is_level and is_cap moved to [algorithm]: a run directory's
    config.toml of an earlier release reads the same objective."""
    old = validate_config({"trainer": {"clip_eps": 0.1, "kl_coef": 0.05, "is_level": "sequence", "is_cap": 4.0}})
    a = old.algorithm
    assert (a.clip_low, a.clip_high, a.kl_coef, a.rollout_is, a.rollout_is_threshold) == (0.1, 0.1, 0.05, "token", 4.0)
    assert (a.rollout_rs, a.rollout_rs_threshold, a.rollout_rs_threshold_lower) == ("geometric", 4.0, 0.25)
    assert validate_config({"trainer": {"is_level": "off"}}).algorithm.rollout_is == "off"
