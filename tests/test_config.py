import pytest

from asyncrl.config import ConfigError, load_config, parse_overrides


def test_defaults_run_the_cpu_demo():
    cfg = load_config()
    assert cfg.model.path == "models/tiny-default"
    assert (cfg.task.name, cfg.task.chat, cfg.warmstart.tokenizer, cfg.warmstart.architecture) == \
        ("basic_arithmetic", True, "bpe", "qwen3")
    assert cfg.task.holdout > 0 and cfg.task.eval_size >= 500
    assert cfg.objective.name in ("ppo_clip", "decoupled_ppo")


def test_overrides_are_typed():
    tree = parse_overrides(
        ["--rollout.max_staleness", "4", "--run.name=x", "--objective.behav_weight_cap", "2.5"]
    )
    assert tree == {
        "rollout": {"max_staleness": 4},
        "run": {"name": "x"},
        "objective": {"behav_weight_cap": 2.5},
    }
    cfg = load_config(overrides=["--rollout.max_staleness", "4", "--run.name", "x"])
    assert cfg.rollout.max_staleness == 4 and cfg.run.name == "x"


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--rollout.max_stalenes", "4"])
    msg = str(err.value)
    assert "rollout.max_stalenes" in msg and "max_staleness" in msg and "group_size" in msg


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match="unknown key 'rollouts'"):
        load_config(overrides=["--rollouts.group_size", "4"])


def test_bad_value_names_key_value_and_constraint():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--rollout.max_staleness", "-1"])
    msg = str(err.value)
    assert "rollout.max_staleness" in msg and "-1" in msg and "greater than or equal to 0" in msg


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_inf_and_nan_are_rejected_like_any_bad_value(value):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--trainer.lr", value])
    assert "trainer.lr" in str(err.value) and "finite" in str(err.value)
    with pytest.raises(ConfigError):
        load_config(overrides=["--objective.eps_high", value])


def test_bad_choice_lists_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--objective.name", "ppo_clipp"])
    assert "ppo_clipp" in str(err.value) and "decoupled_ppo" in str(err.value)
    with pytest.raises(ConfigError, match="recompute"):
        load_config(overrides=["--objective.prox", "exact"])


def test_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\nmax_staleness = 2\n[run]\nname = "t"\n')
    cfg = load_config(path, ["--rollout.group_size", "3"])
    assert (cfg.rollout.max_staleness, cfg.rollout.group_size, cfg.run.name) == (2, 3, "t")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    path.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_auto_thread_split():
    sync = load_config(overrides=["--rollout.max_staleness", "0"])
    async_ = load_config(overrides=["--rollout.max_staleness", "2"])
    from asyncrl.cores import usable_cores

    cores = usable_cores()
    assert sync.role_threads("trainer") == cores
    assert async_.role_threads("trainer") == max(1, cores // 2)


def test_example_recipes_load():
    from pathlib import Path

    examples = Path(__file__).parent.parent / "examples"
    for path in sorted(examples.rglob("*.toml")):  # (agents/ too)
        load_config(path)
    # the spelled-out demo is the defaults (else it would warm-start a policy of its own)
    spelled, defaults = load_config(examples / "tiny_default.toml"), load_config()
    assert spelled.model_dump(exclude={"run": {"name"}}) == defaults.model_dump(exclude={"run": {"name"}})


def test_rules_across_sections():
    with pytest.raises(
        ConfigError, match="rollout.advantage = 'dr_grpo' and objective.loss_agg = 'constant'"
    ):
        load_config(overrides=["--objective.name", "dr_grpo"])
    load_config(
        overrides=[
            "--objective.name",
            "dr_grpo",
            "--rollout.advantage",
            "dr_grpo",
            "--objective.loss_agg",
            "constant",
        ]
    )
    with pytest.raises(ConfigError, match="running_baseline"):
        load_config(overrides=["--rollout.group_size", "1"])
    with pytest.raises(ConfigError, match="update_policy = 'finish'"):
        load_config(overrides=["--inference.engine", "vllm"])


def test_the_warm_start_recipe_ignores_the_rl_run_seeds():
    """Reseeding an RL run must reuse the default policy; changing what it learned from rebuilds it."""
    from asyncrl.policy.warmstart import recipe

    base = recipe(load_config())
    assert recipe(load_config(overrides=["--task.seed", "1001", "--run.seed", "3"])) == base
    assert recipe(load_config(overrides=["--warmstart.seed", "1"])) != base
    assert recipe(load_config(overrides=["--task.prompt_format", "question"])) != base


@pytest.mark.parametrize("name", ["..", ".", "/", "a/b", "../x", "", "x y"])
def test_run_name_is_a_plain_name(name):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["--run.name", name])
    assert "run.name" in str(err.value)


@pytest.mark.parametrize("text", ["nan", "inf", "123", "true", "1e3"])
def test_a_text_setting_keeps_what_was_typed(text):
    """Override values are parsed as TOML literals, except where the setting is text: `--run.name nan`
    is a run called nan, not a float that fails validation."""
    cfg = load_config(overrides=["--run.name", text, "--task.verifier", f"{text}:fn", "--rollout.advantage",
                                 "rloo", "--trainer.lr", "1e-3"])
    assert cfg.run.name == text and cfg.task.verifier == f"{text}:fn"
    assert cfg.rollout.advantage == "rloo" and cfg.trainer.lr == 1e-3


def test_overwrite_deletes_only_an_asyncrl_run(tmp_path):
    from asyncrl.run.launcher import prepare_run_dir

    precious = tmp_path / "runs" / "thesis"
    precious.mkdir(parents=True)
    (precious / "chapter1.tex").write_text("...")
    cfg = load_config(overrides=["--run.root", str(tmp_path / "runs"), "--run.name", "thesis",
                                 "--run.overwrite", "true"])
    with pytest.raises(ConfigError, match="not an asyncrl run directory"):
        prepare_run_dir(cfg)
    assert (precious / "chapter1.tex").exists()
    (precious / "chapter1.tex").unlink()
    prepare_run_dir(cfg)  # an empty directory, then a run's own directory, are replaced
    (precious / "leftover").write_text("x")
    prepare_run_dir(cfg)
    assert not (precious / "leftover").exists() and (precious / "config.json").exists()


def test_a_live_run_refuses_a_second_launcher_and_a_dead_launchers_lock_is_taken_over(tmp_path):
    import os
    import subprocess
    import sys

    from asyncrl.run.launcher import prepare_run_dir, resume, train
    from asyncrl.run.lock import run_lock

    cfg = load_config(overrides=["--run.root", str(tmp_path / "runs"), "--run.name", "live",
                                 "--run.overwrite", "true"])
    prepare_run_dir(cfg)
    with run_lock(cfg.run_dir):  # this process is the live launcher
        for second in (lambda: train(cfg), lambda: resume(cfg.run_dir)):
            with pytest.raises(ConfigError, match=f"is live: launcher PID {os.getpid()} holds"):
                second()
        assert (cfg.run_dir / "config.json").exists()  # the overwrite did not delete the live run
    # a launcher SIGKILLed while it held the lock: the kernel released it, the next one takes it
    code = ("import os, signal; from asyncrl.run.lock import run_lock\n"
            f"with run_lock({str(cfg.run_dir)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    with run_lock(cfg.run_dir) as path:
        assert path.read_text() == str(os.getpid())
