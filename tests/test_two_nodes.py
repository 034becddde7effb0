"""The RL stage on a Ray cluster of two nodes: a head and a second node on this machine, a core each."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.ray_cluster import HeadPorts, LocalRayHead, _ray_executable

from stage_runs import metrics_of, run_stage

# A two-node Ray cluster running an RL stage: the full suite's tier.
pytestmark = pytest.mark.slow

ALL_INTERFACES = "0.0.0.0"


class SecondNode(LocalRayHead):
    """A node joining the cluster at `head_gcs` from 127.0.0.2, this machine's other loopback address, started and
    stopped as a local head is (its own process group and temp folder)."""

    def __init__(self, head_gcs: str):
        super().__init__(num_cpus=1, bind_host=ALL_INTERFACES)
        self.head_gcs = head_gcs

    def command(self, ports: HeadPorts) -> list[str]:
        return [_ray_executable(), "start", "--block", f"--address={self.head_gcs}", "--node-ip-address=127.0.0.2",
                f"--num-cpus={self.num_cpus}", f"--temp-dir={self._temp_dir}", "--disable-usage-stats"]

    def ready(self, address: str) -> bool:
        return "will now block forever" in self._log_path.read_text(errors="replace")

    def worker_logs(self) -> list[Path]:
        """Logs of the Python workers (rank actors, engines) this node ran."""
        return list(Path(self._temp_dir).glob("session_*/logs/worker-*.out"))


@pytest.fixture
def two_nodes():
    """(GCS address, the second node). A cluster that takes other nodes cannot keep its head on loopback only (Ray's
    loopback switch is single-node: infra/ray_cluster.py), so this head listens on every interface while the test
    runs, as a real cluster's head does on its network."""
    with LocalRayHead(num_cpus=1, bind_host=ALL_INTERFACES) as head:
        node = SecondNode(head.gcs_address)
        node.start()
        try:
            yield head.gcs_address, node
        finally:
            node.stop()


def test_rl_with_ranks_and_engines_on_two_nodes_learns(two_nodes, assets, sft_model, tmp_path):
    """GRPO with two actor ranks, two reference ranks and two engines colocated on two bundles of a core each: one
    node cannot hold both bundles, so each node runs one rank process and one engine, their torch.distributed and
    weight-sync groups joined across the nodes. Held-out accuracy rises as on one node."""
    gcs_address, node = two_nodes
    out = tmp_path / "rl"
    proc = run_stage("rl", "--pretrain", sft_model, "--remote_rm_url", "stages/tiny_reward.py",
                     "--prompt_data", assets["prompts_train"], "--eval_dataset", assets["prompts_eval"],
                     "--max_samples", 320, "--eval_steps", 10, "--eval_n_samples_per_prompt", 0,
                     "--actor_num_nodes", 2, "--actor_num_gpus_per_node", 1, "--ref_num_nodes", 2,
                     "--ref_num_gpus_per_node", 1, "--vllm_num_engines", 2,
                     "--save_path", out / "model", "--ckpt_path", out / "ckpt", ray_address=gcs_address)
    assert "roles {'actor': 2, 'ref': 2} + 2 engine(s)" in proc.stdout
    assert node.worker_logs(), "nothing ran on the second node"
    metrics = metrics_of(out / "model")
    assert metrics["steps"] == 10
    assert metrics["eval_reward"] >= metrics["eval_reward_initial"] + 0.4, metrics
