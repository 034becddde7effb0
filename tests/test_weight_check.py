"""The weight check's digests and their comparison (stages/rl/weight_check.py), on tensors split the way engines split
them: fused q/k/v, column- and row-parallel shards over tensor-parallel workers, replicated key/value heads, padded
vocabulary shards, packed layouts. Pure torch; the engines' side runs in tests/test_rollout.py and tests/test_rl.py."""

from __future__ import annotations

import pytest
import torch

from stages.rl.weight_check import RTOL, ReadBack, TensorDigest, digest, mismatches, probe_vector, with_tied_digests

HIDDEN = 16


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(16, HIDDEN, generator=g), "k": torch.randn(8, HIDDEN, generator=g),
            "v": torch.randn(8, HIDDEN, generator=g), "o": torch.randn(HIDDEN, 16, generator=g),
            "norm": torch.randn(HIDDEN, generator=g), "embed": torch.randn(10, HIDDEN, generator=g)}


def sent_of(w: dict[str, torch.Tensor]) -> dict[str, TensorDigest]:
    return {name: digest(t, torch.float32) for name, t in w.items()}


def engine_readings(w: dict[str, torch.Tensor], tp: int) -> list[list[ReadBack]]:
    """What `tp` workers of an engine read back, laid out as vLLM lays them out: q/k/v fused and split by heads over
    the workers (column-parallel), o split by its input (row-parallel: partial outputs), the norm replicated, the
    embedding split by vocabulary rows with the last shard padded with zero rows."""
    x16 = probe_vector(16, torch.float32)
    workers = []
    for rank in range(tp):
        part = lambda t: t.chunk(tp)[rank]  # noqa: E731
        qkv = torch.cat([part(w["q"]), part(w["k"]), part(w["v"])])
        o_shard = w["o"][:, rank * 16 // tp : (rank + 1) * 16 // tp]
        x_shard = probe_vector(16, torch.float32)[rank * 16 // tp : (rank + 1) * 16 // tp]
        rows = -(-10 // tp)
        embed = torch.zeros(rows, HIDDEN)
        mine = w["embed"][rank * rows : (rank + 1) * rows]
        embed[: len(mine)] = mine
        workers.append([
            ReadBack("qkv", (("q", 1), ("k", 1), ("v", 1)), "wx", (float((qkv @ x16).double().square().sum()),),
                     "sum"),
            ReadBack("o", (("o", 1),), "wx", (o_shard @ x_shard).double(), "vector"),
            ReadBack("norm", (("norm", 1),), "moments",
                     (float(w["norm"].abs().sum()), float(w["norm"].square().sum()))),
            ReadBack("embed", (("embed", 1),), "wx", (digest(embed, torch.float32).wx_sq,), "sum"),
        ])
    return workers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_an_engine_split_over_workers_reads_back_what_was_sent(tp):
    w = weights()
    assert mismatches(sent_of(w), engine_readings(w, tp), RTOL["float32"]) == []


@pytest.mark.parametrize("altered", ["q", "v", "o", "norm", "embed"])
def test_a_scaled_tensor_is_named_on_any_worker_split(altered):
    w = weights()
    sent = sent_of(w)
    changed = dict(w, **{altered: w[altered] * 1.5})
    for tp in (1, 2):
        problems = mismatches(sent, engine_readings(changed, tp), RTOL["float32"])
        # A replicated tensor is wrong on every worker that holds it, the others once.
        assert len(problems) == (tp if altered == "norm" else 1), problems
        assert all(altered in problem.split(":")[0] and "the actor sent" in problem for problem in problems)


def test_half_loaded_fused_weights_and_stale_weights_are_seen():
    w, newer = weights(0), weights(1)
    half = dict(w, k=torch.zeros_like(w["k"]))  # a fused matrix finished from memory never loaded
    assert mismatches(sent_of(w), engine_readings(half, 2), RTOL["float32"])
    assert len(mismatches(sent_of(newer), engine_readings(w, 2), RTOL["float32"])) == 5  # old ones: norm on both


def test_replicated_key_value_heads_count_once_and_a_replicated_norm_must_match_on_every_worker():
    w = weights()
    sent = sent_of(w)
    x = probe_vector(HIDDEN, torch.float32)
    # tp 4 with 2 key/value heads of 4 rows: each worker holds a quarter of q and one key/value head twice over.
    readings = []
    for rank in range(4):
        kv = torch.cat([w["k"][(rank // 2) * 4 : (rank // 2 + 1) * 4], w["v"][(rank // 2) * 4 : (rank // 2 + 1) * 4]])
        readings.append([ReadBack("qkv[q]", (("q", 1),), "wx", (float((w["q"].chunk(4)[rank] @ x).square().sum()),),
                                  "sum"),
                         ReadBack("qkv[kv]", (("k", 2), ("v", 2)), "wx", (float((kv @ x).square().sum()),), "sum"),
                         ReadBack("norm", (("norm", 1),), "moments",
                                  (float(w["norm"].abs().sum()), float(w["norm"].square().sum())))])
    assert mismatches(sent, readings, RTOL["float32"]) == []
    readings[3][2] = ReadBack("norm", (("norm", 1),), "moments", (0.0, 0.0))  # one worker never loaded its copy
    [problem] = mismatches(sent, readings, RTOL["float32"])
    assert problem.startswith("norm on worker 3: (Σ|w|, Σw²) 0, 0, the actor sent")


def test_packed_layouts_and_engine_rounding_pass_and_what_was_never_sent_is_named():
    w = weights()
    sent = sent_of(w)
    # A CPU kernel keeps a weight transposed and blocked: the moments and ||W x||² do not see layout.
    packed = w["norm"].flip(0)
    assert mismatches(sent, [[ReadBack("norm", (("norm", 1),), "moments",
                                       (float(packed.abs().sum()), float(packed.square().sum())))]], 1e-6) == []
    # bfloat16 rounding of the engine's outputs stays inside its tolerance.
    bf16 = digest(w["q"], torch.bfloat16).wx_sq
    rounded = float((w["q"].bfloat16() @ probe_vector(HIDDEN, torch.bfloat16)).double().square().sum())
    assert abs(rounded - bf16) <= RTOL["bfloat16"] * bf16
    [problem] = mismatches(sent, [[ReadBack("lm_head", (("lm_head", 1),), "wx", (1.0,))]], RTOL["float32"])
    assert problem == "lm_head holds lm_head, which the actor did not send"
    tied = with_tied_digests(sent, {"lm_head": "embed"})
    assert mismatches(tied, [[ReadBack("lm_head", (("lm_head", 1),), "wx", (sent["embed"].wx_sq,))]], 1e-6) == []


def test_digests_worked_numbers():
    matrix = torch.tensor([[1.0, -2.0], [0.5, 0.0]])
    x = probe_vector(2, torch.float32).double()
    expected = float((matrix.double() @ x).square().sum())
    assert digest(matrix, torch.float32) == TensorDigest(wx_sq=pytest.approx(expected, rel=1e-7))
    assert digest(torch.tensor([1.0, -2.0, 0.5]), torch.float32) == TensorDigest(abs_sum=3.5, sq_sum=5.25)
    # Rows beyond a chunk are summed chunk by chunk to the same value.
    big = torch.randn(3000, 7000, generator=torch.Generator().manual_seed(0))
    whole = float((big.double() @ probe_vector(7000, torch.float32).double()).square().sum())
    assert digest(big, torch.float32).wx_sq == pytest.approx(whole, rel=1e-6)
