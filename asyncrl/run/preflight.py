"""What is checked before any process starts: a bad model, task, objective or agent fails here in
one sentence naming it, not minutes later inside a role that restarts into the same error."""
from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.config.policy import ModelConfig
from asyncrl.config.scale import apply_profile
from asyncrl.observe.sinks import check_installed
from asyncrl.run.sizes import check_sizes

DEFAULT_MODEL = ModelConfig().path
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_inputs(cfg: Config, log=print) -> Config:
    """Fail before any process starts: model, task and objective must all resolve. Returns the config
    with the policy the run will use (a tiny one built here if it is missing)."""
    from asyncrl.objectives import get_objective
    from asyncrl.rewards.tasks import load_tasks

    load_tasks(cfg.task)  # (a bad task fails here, before a warm start would spend minutes)
    cfg = resolve_models(cfg, log)
    if cfg.teacher.enabled:
        check_teacher_loads(cfg)  # (likewise)
    own_recipe = cfg.warmstart.demos or cfg.warmstart.architecture == "qwen2_5_vl"  # (examples/ recipes)
    buildable = (cfg.model.path == DEFAULT_MODEL or own_recipe) and cfg.model.warmstart_if_missing
    if buildable:
        cfg = _tiny_policy(cfg, log)
    elif not Path(cfg.model.path).exists():
        _check_hub_model(cfg.model.path)
    if Path(cfg.model.path).exists():
        check_model(Path(cfg.model.path))
    cfg = apply_profile(cfg, Path(cfg.model.path), log)
    _check_prompts(cfg, log)
    _check_images(cfg)
    agents = {path for path in cfg.agent_paths().values() if path}
    if agents:
        from asyncrl.agents.runner import chat_template, load_agent

        for path in agents:
            load_agent(path)
        chat_template(cfg.agent.chat_template)
    get_objective(cfg.objective.name, cfg.objective.import_path)
    if cfg.teacher.enabled:
        check_teacher_fits(cfg)
    check_installed(cfg)  # (the metric sinks asked for)
    check_sizes(cfg)
    _check_ports(cfg)
    return cfg


def resolve_models(cfg: Config, log=print) -> Config:
    """The config with every model it names as a directory the roles can load: a GGUF file (or a
    directory holding one) becomes its converted directory (asyncrl/policy/gguf.py), said on the console; a
    file inside an installed package ("package:NAME/FILE") its path."""
    from asyncrl.plugins import package_file
    from asyncrl.policy.gguf import gguf_file, model_dir

    changes = {}
    for section, key in (("model", "path"), ("teacher", "path"), ("warmstart", "base")):
        given = getattr(getattr(cfg, section), key)
        if not given:
            continue
        path = package_file(given, f"{section}.{key}")
        found = gguf_file(path, f"{section}.{key}")
        if found is not None:
            path = str(model_dir(found, log))
            log(f"{section}.{key}: {given} is served and trained from its converted copy {path}")
        if path != given:
            changes.setdefault(section, {})[key] = path
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)
                                  for section, fields in changes.items()})


def _check_ports(cfg: Config) -> None:
    """The ports the user asked for (inference.port: replica i takes port + i) are free here. (Under Ray
    the replicas bind on the nodes they land on, and say so there.)"""
    first, host = cfg.inference.port, cfg.inference.host
    if not first or cfg.run.launcher == "ray":
        return
    if first + cfg.inference.replicas - 1 > 65535:
        raise ConfigError(f"inference.port = {first} with {cfg.inference.replicas} replicas runs past port "
                          "65535 (replica i takes port + i)")
    for index in range(cfg.inference.replicas):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as the server binds)
            try:
                probe.bind((host, first + index))
            except OSError as e:
                raise ConfigError(f"inference.port = {first}: port {first + index} (replica {index}) on "
                                  f"{host} cannot be bound ({e.strerror or e}); choose free ports, or 0 to "
                                  "pick them") from None


def _tiny_policy(cfg: Config, log) -> Config:
    """The config with the tiny policy of its warm-start recipe, built if missing. A policy another
    recipe built is never overwritten (a user may rely on it): the default path gives way to
    models/tiny-<recipe hash>, and an explicit path is refused."""
    from asyncrl.policy.warmstart import OTHER, build_state, recipe_hash

    path = Path(cfg.model.path)
    if build_state(cfg, path) == OTHER:
        if cfg.model.path != DEFAULT_MODEL:
            raise ConfigError(f"model.path = {cfg.model.path!r} was warm-started by another recipe (see its "
                              "warmstart.json) and is not overwritten: pass a new --model.path to build this "
                              "recipe's policy there")
        path = path.parent / f"tiny-{recipe_hash(cfg)}"
        log(f"{DEFAULT_MODEL} was warm-started by another recipe (see its warmstart.json): this run's "
            f"policy is {path}")
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path)})})
    build_policy(cfg, path, log)
    return cfg


def build_policy(cfg: Config, path: Path, log=print) -> None:
    """Build the tiny policy at `path` unless it is there, built to its end. One process builds it at a time:
    another that needs it waits for that build (saying so) and uses it."""
    from asyncrl.files import exclusive
    from asyncrl.policy.warmstart import COMPLETE, CUT_SHORT, OTHER, build_state, warmstart

    if build_state(cfg, path) == COMPLETE:
        return
    deadline = 2 * cfg.warmstart.max_seconds + 600  # (the other build's, then its evaluation and save)
    with exclusive(path.with_name(f".{path.name}.lock"), f"the build of {path}", deadline, log):
        state = build_state(cfg, path)
        if state == COMPLETE:  # (another process built it while this one waited)
            log(f"{path}: built by another process meanwhile; using it")
            return
        why = {OTHER: "holds another recipe's policy (a tiny-<hash> directory is asyncrl's own)",
               CUT_SHORT: "was cut short (warmstart.max_seconds) the last time"}.get(state, "is missing")
        log(f"{path} {why}: building the tiny policy first")
        warmstart(cfg, path, log=log)



def _check_prompts(cfg: Config, log) -> None:
    """task.chat needs a chat template; a thin held-out set is said before the run, not found after it."""
    from asyncrl.rewards.tasks import eval_entries, load_tasks

    model = Path(cfg.model.path)
    if cfg.task.chat and model.is_dir() and not _has_chat_template(model):
        raise ConfigError(f"task.chat = true but the tokenizer in {model} has no chat template; "
                          "set task.chat = false to send prompts as plain text")
    held_out = load_tasks(cfg.task, held_out=True) if cfg.task.eval_size else None
    found = len(eval_entries(held_out, cfg.task.eval_size)) if held_out else cfg.task.eval_size
    if found < cfg.task.eval_size:
        why = (
            (
                f"task.holdout = {cfg.task.holdout} keeps few of a task with few distinct items apart "
                "(task.holdout = 0 "
                "evaluates on the whole task instead)"
            )
            if cfg.task.holdout
            else "the task has no more distinct items"
        )
        log(
            f"evaluation: {found} distinct held-out items of the {cfg.task.eval_size} asked "
            f"(task.eval_size): {why}"
        )


def _check_images(cfg: Config) -> None:
    """A task whose rows show images needs a vision-language policy, served by the built-in engine."""
    from asyncrl.rewards.tasks import BadTaskRow, load_tasks

    try:
        shows = bool(load_tasks(cfg.task).item(0).get("images"))
    except BadTaskRow:  # (its own check reports it)
        return
    if not shows:
        return
    config = _config_json(Path(cfg.model.path)) if Path(cfg.model.path).is_dir() else {}
    if Path(cfg.model.path).is_dir() and "vision_config" not in config:
        raise ConfigError(f"task {cfg.task.name!r} shows images, but model.path = {cfg.model.path!r} is a "
                          f"text-only model ({config.get('model_type', 'no model_type')}): use a "
                          "vision-language model (e.g. warmstart.architecture = \"qwen2_5_vl\")")
    if cfg.inference.engine == "vllm":
        raise ConfigError(f"task {cfg.task.name!r} shows images: inference.engine = \"vllm\" has no "
                          "multimodal path in asyncrl yet; use the built-in engine")


def _config_json(model: Path) -> dict:
    try:
        return json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _has_chat_template(model: Path) -> bool:
    if (model / "chat_template.jinja").exists():
        return True
    try:
        return bool(json.loads((model / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError):
        return False


def _check_hub_model(name: str, key: str = "model.path") -> None:
    """A name that is no local file or directory must resolve on the hub or in its local cache. Offline (the
    common case on a build machine) that is said at once, and the roles are told not to try the hub either:
    transformers would otherwise retry a hub nobody can reach for ~25 s in every process."""
    from transformers import AutoConfig

    if not HUB_NAME.fullmatch(name):
        raise ConfigError(f"{key} = {name!r}: no such file or directory here (nor a hub name, which reads "
                          "org/name)")
    online, endpoint = hub_reachable()
    if not online:
        os.environ["HF_HUB_OFFLINE"] = "1"  # (inherited by every role the launcher starts)
    try:
        AutoConfig.from_pretrained(name, local_files_only=not online)
    except Exception as e:
        where = "the hub" if online else (f"the local hub cache, and the hub ({endpoint}) cannot be reached "
                                          "from this machine")
        hint = "run `asyncrl warmstart` for the tiny default, or" if key == "model.path" else ""
        raise ConfigError(f"{key} = {name!r} is not a local file or directory and is not in {where} "
                          f"({type(e).__name__}); {hint} give a model directory or GGUF file that is here"
                          ) from None


HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")  # (huggingface_hub's repo id rule)


def hub_reachable(seconds: float = 3.0) -> tuple[bool, str]:
    """(whether the hub's endpoint answers a TCP connection within `seconds`, the endpoint); False at once
    when HF_HUB_OFFLINE is set."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false"):
        return False, constants.ENDPOINT
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=seconds).close()
        return True, constants.ENDPOINT
    except OSError:
        return False, constants.ENDPOINT


def check_teacher(cfg: Config) -> None:
    """On-policy distillation's teacher: a model that loads, with the student's tokenizer (the objective
    compares logprobs of the same token ids; cross-tokenizer distillation is out of scope), and for a
    server someone else runs, its token."""
    check_teacher_loads(cfg)
    check_teacher_fits(cfg)


def check_teacher_loads(cfg: Config) -> None:
    """The teacher's model loads, or its server's token is there: needs no student (so it runs before a
    warm start would spend minutes building one)."""
    teacher = cfg.teacher
    if teacher.url:
        token = Path(teacher.token_file)
        if not token.is_file() or not token.read_text().strip():
            raise ConfigError(f"teacher.token_file = {teacher.token_file!r} is missing or empty: it must "
                              f"hold the token of the teacher server at {teacher.url}")
    elif Path(teacher.path).exists():
        check_model(Path(teacher.path), "teacher.path")
    else:
        _check_hub_model(teacher.path, "teacher.path")


def check_teacher_fits(cfg: Config) -> None:
    """The teacher's context holds the longest sample, and its tokenizer is the student's."""
    teacher = cfg.teacher
    _check_teacher_context(cfg)
    student, theirs = _vocabulary(cfg.model.path), _vocabulary(teacher.path)
    if student != theirs:
        differ = sorted(set(student.items()) ^ set(theirs.items()))
        raise ConfigError(
            f"teacher.path = {teacher.path!r} has another tokenizer than the student's model.path = "
            f"{cfg.model.path!r} ({len(theirs)} tokens against {len(student)}; {len(differ)} token/id pairs "
            f"differ, e.g. {differ[:3]}): distillation compares the logprobs of the same token ids, so the "
            "teacher must share the student's tokenizer (cross-tokenizer distillation is out of scope)")


def _check_teacher_context(cfg: Config) -> None:
    """The teacher scores whole samples: the longest must fit its context too."""
    from asyncrl.run.sizes import longest_sequence, model_config

    if not Path(cfg.teacher.path).is_dir():
        return  # a hub name: its config is read when the teacher loads it
    context = (model_config(Path(cfg.teacher.path)) or {}).get("max_position_embeddings")
    tokens, what = longest_sequence(cfg)
    if context and tokens > context:
        raise ConfigError(f"teacher.path = {cfg.teacher.path!r} holds {context} positions "
                          f"(max_position_embeddings), fewer than a sample's {tokens} tokens ({what}): it "
                          "could not score whole samples")


def _vocabulary(path: str) -> dict[str, int]:
    """token -> id of a model's tokenizer, added tokens included."""
    if (Path(path) / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()



def check_model(path: Path, key: str = "model.path") -> None:
    """A local model directory must hold a readable config, a tokenizer and complete weights; each
    problem is one ConfigError naming the file."""
    where = f"{key} = {str(path)!r}"
    if not path.is_dir():
        raise ConfigError(f"{where} is a file, not a model directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        held = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise ConfigError(f"{where} has no config.json: not a Hugging Face model directory "
                          f"(it holds: {held})") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: config.json cannot be read: {e}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"{where}: config.json has no model_type")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    _check_vocabulary(path, config, where)
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not list(path.glob("pytorch_model*.bin")):
        raise ConfigError(f"{where} has no weights (no *.safetensors or pytorch_model*.bin)")
    for shard in shards:
        problem = _safetensors_problem(shard)
        if problem:
            raise ConfigError(f"{where}: {shard.name} {problem}")


def _check_vocabulary(path: Path, config: dict, where: str) -> None:
    """The tokenizer loads, and its ids fit the model's embedding (an id past it crashes the engine).
    A tokenizer.json is read by `tokenizers` alone (milliseconds); others by transformers."""
    try:
        if (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer

            tokens = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        else:
            from transformers import AutoTokenizer

            tokens = len(AutoTokenizer.from_pretrained(path))
    except Exception as e:
        raise ConfigError(f"{where}: its tokenizer cannot be loaded: {type(e).__name__}: {e}") from None
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if size and tokens > size:
        raise ConfigError(f"{where}: the tokenizer has {tokens} tokens but the model's embedding only "
                          f"{size} (config.json vocab_size): a tokenizer from another model?")


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file cannot be complete (truncated, not safetensors), from its header alone."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return f"is truncated or not a safetensors file ({size} bytes; its header claims {length})"
            header = json.loads(f.read(length))
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"is not a readable safetensors file ({size} bytes)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"is truncated: {size} bytes, its header needs {8 + length + end}"
    return None
