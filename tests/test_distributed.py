"""Real multi-process training with the gloo backend: torchrun, two 'nodes', the CLI's own launcher.

Each test starts real processes (about 6-10 s each on 2 cores), so there are few of them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compose_config, free_port, run_cli, torchrun, write_text_corpus
from train_layouts import launch_layouts, train_here

TINY = ["model=tiny", "train.seq_len=64", "train.eval_windows=16", "sample.max_new_tokens=0", "progress=plain"]


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def corpus_args(text_corpus: Path, tmp_path: Path) -> list[str]:
    return ["data=text", f"data.path={text_corpus}", f"data.cache_dir={tmp_path / 'cache'}"]


@pytest.fixture(scope="module")
def corpus_folder(tmp_path_factory) -> Path:
    """A folder with the text corpus, for the module's shared runs."""
    folder = tmp_path_factory.mktemp("shared")
    write_text_corpus(folder / "corpus")
    return folder


@pytest.fixture(scope="module")
def shared_data(corpus_folder) -> list[str]:
    """The overrides of the module's shared runs and of the runs compared with them."""
    return corpus_args(corpus_folder / "corpus", corpus_folder)


# The two-rank DDP runs of several tests below, by name.
DDP_RUNS = {
    "double_batch": ["train.max_steps=10", "train.log_every=1", "train.eval_every=100", "train.batch_size=4"],
    "unmeasured": ["train.max_steps=6", "train.log_every=2"],
    "measured": ["train.max_steps=6", "train.log_every=2", "train.log_grad_consistency=true"],
    "one_node": ["train.max_steps=6", "train.log_every=1"],
}


@pytest.fixture(scope="module")
def ddp_runs(corpus_folder, shared_data) -> dict[str, Path]:
    """DDP_RUNS, one after the other in one two-rank launch (tests/train_layouts.py)."""
    return launch_layouts(corpus_folder, 2, DDP_RUNS, *TINY, *shared_data)


@pytest.mark.slow
def test_torchrun_ranks_share_one_run_folder_written_by_rank_0(tmp_path, text_corpus):
    """No hydra.run.dir: each rank resolves ${now:} itself, yet one folder must result."""
    result = torchrun(
        "--nproc_per_node=2", "-m", "ciuic_train", *TINY, *corpus_args(text_corpus, tmp_path),
        "train.max_steps=12", "train.log_every=4", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = [p.parent for p in (tmp_path / "outputs").glob("*/*/summary.json")]
    assert len(list((tmp_path / "outputs").glob("*/*"))) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "ddp"
    assert [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()] == [4, 8, 12]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".ciuic-train.lock", ".hydra", "checkpoints", "metrics.jsonl", "summary.json", "train.log"
    ]
    holder = json.loads((run_dir / ".ciuic-train.lock").read_text())  # rank 0 held it for the job
    assert holder["command"].startswith("ciuic-train ") and "train.max_steps=12" in holder["command"]
    assert result.stdout.count("step 12 |") == 1  # rank 0 alone reports


@pytest.mark.slow
def test_two_nodes_over_c10d_rendezvous_agree(tmp_path, ddp_runs, shared_data):
    port, run_dir = free_port(), tmp_path / "run"
    common = [
        "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=two-nodes", "-m", "ciuic_train", *TINY, *shared_data, *DDP_RUNS["one_node"], f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--node_rank={rank}", *common],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # The run fails on every rank if the replicas' checksums differ; it passed, and says so.
    assert summary["world_size"] == 2
    # Two nodes are two ranks as one node's two are: the same weights, bit for bit (a sum
    # of two is the same in either order); and the one-process run of the double batch
    # follows the same losses, up to summation order.
    one_node = ddp_runs["one_node"]  # the same overrides, on one node's two ranks
    assert json.loads((one_node / "summary.json").read_text())["param_checksum"] == summary["param_checksum"]
    batch = compose_config(*TINY).train.batch_size
    single = train_here(tmp_path, {"single": [*DDP_RUNS["one_node"], f"train.batch_size={2 * batch}"]},
                        *TINY, *shared_data)["single"]
    assert len(losses(run_dir)) == 6
    assert losses(run_dir) == pytest.approx(losses(single), rel=1e-4)


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_with_the_double_batch(tmp_path, ddp_runs, shared_data):
    """Rank shares of the epoch are strided, so ranks' batches of B together are the one-process batch of 2B.

    The gradients are then equal up to float summation order (all-reduce of two halves
    vs one sum), about 1e-7 relative per step; Adam's normalisation keeps later steps
    close, so 10 steps agree to rtol 1e-4.
    """
    ddp = ddp_runs["double_batch"]
    assert json.loads((ddp / "summary.json").read_text())["strategy"] == "ddp"
    single = train_here(tmp_path, {"single": [*DDP_RUNS["double_batch"], "train.batch_size=8"]},
                        *TINY, *shared_data)["single"]
    assert len(losses(ddp)) == 10
    assert losses(ddp) == pytest.approx(losses(single), rel=1e-4)
    assert losses(ddp)[-1] < losses(ddp)[0]


@pytest.mark.slow
def test_cli_launcher_trains_fsdp_on_two_processes(tmp_path, text_corpus):
    run_dir = tmp_path / "run"
    result = run_cli(
        "dist.nproc_per_node=2", "dist.strategy=fsdp", *TINY, *corpus_args(text_corpus, tmp_path),
        "train.max_steps=12", "train.log_every=4", "train.grad_accum=2", f"hydra.run.dir={run_dir}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp"
    assert losses(run_dir)[-1] < losses(run_dir)[0] - 0.3
    assert (run_dir / ".hydra" / "config.yaml").is_file()


@pytest.mark.slow
def test_ranks_with_different_configs_are_refused(tmp_path, text_corpus):
    result = torchrun(
        "--nproc_per_node=2", "-m", "ciuic_train", *TINY, *corpus_args(text_corpus, tmp_path),
        "seed=${oc.env:RANK}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path,
    )
    assert result.returncode != 0
    assert "ranks composed different configs: seed differs between rank 0 and rank 1" in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_sweep_runs_each_job_on_two_processes(tmp_path, text_corpus):
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "-m", "seed=0,1", "dist.nproc_per_node=2", *TINY, *corpus_args(text_corpus, tmp_path),
        "train.max_steps=4", f"hydra.sweep.dir={sweep_dir}", cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads((sweep_dir / str(i) / "summary.json").read_text()) for i in (0, 1)]
    assert [s["world_size"] for s in summaries] == [2, 2]
    assert summaries[0]["param_checksum"] != summaries[1]["param_checksum"]


@pytest.mark.slow
def test_grad_consistency_is_logged_without_changing_the_training(ddp_runs):
    """The metric averages the gradients itself on logging steps, as DDP would have: the
    weights end bit-identical to a run without it."""
    runs = {name: ddp_runs[name] for name in ("unmeasured", "measured")}
    records = [json.loads(line) for line in (runs["measured"] / "metrics.jsonl").read_text().splitlines()]
    consistency = [r["grad_consistency"] for r in records]
    assert len(consistency) == 3 and all(0.0 < c < 1.0 for c in consistency)  # two ranks, two different batches
    assert all("grad_consistency" not in json.loads(line) for line in (runs["unmeasured"] / "metrics.jsonl").read_text().splitlines())
    checksums = [json.loads((runs[name] / "summary.json").read_text())["param_checksum"] for name in runs]
    assert checksums[0] == checksums[1]


@pytest.mark.slow
def test_grad_consistency_on_real_ranks_equals_an_independent_computation(tmp_path):
    """Three gloo ranks with gradients of their own: the metric is the mean over ranks of
    cos(own gradient, mean gradient), computed apart in float64 from every rank's
    gradients gathered, and the gradients are left averaged (tests/consistency_rank.py)."""
    out = tmp_path / "consistency.json"
    result = torchrun("--nproc_per_node=3", str(Path(__file__).with_name("consistency_rank.py")), str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert 0.3 < min(found["cosines"]) and max(found["cosines"]) < 0.95, found  # neither unrelated nor aligned
    assert found["measured"] == pytest.approx(found["expected"], abs=1e-6)
    assert found["max_grad_error"] < 1e-6


@pytest.mark.slow
def test_bf16_fsdp_and_ep_on_two_cpu_ranks_gathers_bf16_and_follows_fp32(tmp_path, text_corpus):
    """The path a sharded bf16 GPU run takes, on gloo: FSDP2 gathers every block's
    parameters (routed experts included, split over ep=2) in bf16 for the forward, keeps
    fp32 weights for AdamW, and the losses follow the fp32 run's to bf16's precision
    (tests/bf16_rank.py records the dtypes each block's forward sees)."""
    result = torchrun(
        "--nproc_per_node=2", str(Path(__file__).with_name("bf16_rank.py")), str(tmp_path), *TINY,
        *corpus_args(text_corpus, tmp_path), "dist.dp_shard=2", "dist.ep=2", "train.max_steps=8", "train.log_every=1",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = {precision: json.loads((tmp_path / f"{precision}.json").read_text()) for precision in ("fp32", "bf16")}
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert bf16["strategy"] == "fsdp" and bf16["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "ep": 2}
    assert fp32["gathered"] == {"experts": ["torch.float32"], "other": ["torch.float32"]}
    assert bf16["gathered"] == {"experts": ["torch.bfloat16"], "other": ["torch.bfloat16"]}
    assert fp32["kept"] == bf16["kept"] == ["torch.float32"]
    assert len(bf16["losses"]) == len(fp32["losses"]) == 8
    assert bf16["losses"] != fp32["losses"]  # bf16 did compute in bf16
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=1e-2)
    assert bf16["val_loss"] == pytest.approx(fp32["val_loss"], rel=1e-2)


@pytest.mark.parametrize("setting, message", [
    ("dist.strategy=fsdp", "train.log_grad_consistency needs replicas' whole gradients (DDP); "
                           "dist.strategy=fsdp shards them (dp_replicate=1 x dp_shard=2, ep=1)"),
    ("+trick=delayed_sync", "train.log_grad_consistency averages gradients itself on logging steps, which would "
                            "bypass trick delayed_sync's communication hook; use one or the other"),
])
def test_grad_consistency_is_refused_where_it_cannot_measure(tmp_path, setting, message):
    result = run_cli(*TINY, "dist.nproc_per_node=2", setting, "train.log_grad_consistency=true",
                     f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"ciuic-train: error: {message}"]
    assert not (tmp_path / "run").exists()


def test_a_communication_failure_is_one_line_naming_the_ranks_and_the_settings(monkeypatch):
    from torch.distributed import DistStoreError

    from ciuic_train.distributed.process_group import lost_peers_message

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "host0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    gloo = RuntimeError("[/src/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:682. Check the logs.")
    message = lost_peers_message(gloo, 30, ["a 10.0.0.1", "b 10.0.0.2", "c 10.0.0.3"])
    assert message.startswith("rank 0 on a 10.0.0.1 lost contact with rank 1 (b 10.0.0.2): "
                              "Connection closed by peer [10.0.0.2]:682. A node died")
    assert "GLOO_SOCKET_IFNAME" in message and "\n" not in message
    never_formed = lost_peers_message(DistStoreError("wait timeout after 30000ms, keys: /x/1"), 30, [])
    assert "could not form the process group through host0:29500 within dist.timeout_s=30 s" in never_formed
    assert lost_peers_message(ValueError("a bug"), 30, []) is None


def test_ddp_takes_its_bucket_size_from_the_config(one_rank_gloo):
    """One rank in a real gloo group is enough to see what DDP was built with."""
    import torch

    from ciuic_train.distributed.mesh import Mesh, MeshShape
    from ciuic_train.distributed.data_parallel import auto_bucket_mb, replicate_with_ddp

    replicas = []
    mesh = Mesh(MeshShape(), torch.device("cpu"))
    replicas.append(replicate_with_ddp(torch.nn.Linear(4, 4), mesh, None, bucket_mb=0.5))
    assert replicas[-1].bucket_bytes_cap == 512 * 1024
    # 0: an eighth of the gradients' bytes, within 1 to 25 MiB.
    sixteen_mib = torch.nn.Linear(1024, 4096, bias=False)  # 4 M fp32 weights
    replicas.append(replicate_with_ddp(sixteen_mib, mesh, None))
    assert replicas[-1].bucket_bytes_cap == 2 * 2**20
    with torch.device("meta"):
        assert auto_bucket_mb(torch.nn.Linear(4, 4)) == 1.0
        assert auto_bucket_mb(torch.nn.Linear(4096, 16384, bias=False)) == 25.0  # 256 MiB: torch's cap


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
def test_ddp_gradients_are_its_buckets_and_train_bit_for_bit_as_copies_did(one_rank_gloo):
    """On a 1-rank gloo group, three AdamW steps of two micro-batches (the first under
    no_sync): with the gradients as views of DDP's buckets, zeroed in place between steps,
    every gradient lies in a bucket, the same memory from the second step on (one copy of the gradients,
    not two), and the parameters end bit for bit where DDP's bucket copies took them."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from ciuic_train.distributed.data_parallel import grads_are_bucket_views, replicate_with_ddp
    from ciuic_train.distributed.grads import grad_sync
    from ciuic_train.distributed.mesh import Mesh, MeshShape
    from ciuic_train.model import ModelConfig, Transformer

    replicas, ends = [], []
    mesh = Mesh(MeshShape(), torch.device("cpu"))
    for views in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(n_layers=2, n_dense_layers=1))
        if views:
            replica = replicate_with_ddp(model, mesh, None, bucket_mb=0.25)
        else:  # what replicate_with_ddp built before: param.grad, copied into the buckets and back
            replica = DistributedDataParallel(model, bucket_cap_mb=0.25, broadcast_buffers=False)
        replicas.append(replica)
        assert replica.gradient_as_bucket_view == views
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1)
        storages = []
        for _ in range(3):
            for sync in (False, True):
                idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=data)
                with grad_sync(replica, "ddp", enabled=sync):
                    (replica(idx, idx) / 2).backward()
            optimizer.step()
            grads = [p.grad for p in model.parameters()]
            storages.append({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads})
            # Set to None until DDP has laid its buckets out again (second step's forward), then zeroed in place.
            assert grads_are_bucket_views(replica) == (views and len(storages) > 1)
            optimizer.zero_grad(set_to_none=not grads_are_bucket_views(replica))
        ends.append([p.detach().clone() for p in model.parameters()])
        grad_bytes = 4 * sum(p.numel() for p in model.parameters())
        if views:
            # The buckets' memory, each holding several gradients: one copy of them. DDP
            # lays its buckets out again after the first step, in the order gradients came.
            assert all(len(step) < len(grads) and sum(step.values()) == grad_bytes for step in storages)
            assert storages[1] == storages[2]
            assert all(g.abs().sum() == 0 for g in (p.grad for p in model.parameters()))  # zeroed, kept
        else:
            assert len(storages[0]) == len(grads)
    assert all(torch.equal(a, b) for a, b in zip(*ends))
    assert not all(torch.equal(a, b) for a, b in zip(ends[0], Transformer(ModelConfig(n_layers=2, n_dense_layers=1)).parameters()))


def test_fsdp_bf16_keeps_the_rope_tables_fp32(one_rank_gloo):
    """The bf16 policy on a 1-rank gloo group: the blocks receive the
    RoPE tables as they are (casting them to bf16 made `apply_rope` fail), train under
    autocast, and reduce fp32 gradients."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ciuic_train.distributed.data_parallel import fsdp_precision
    from ciuic_train.model import ModelConfig, Transformer

    policy = fsdp_precision(bf16=True)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert fsdp_precision(bf16=False).param_dtype is None
    torch.manual_seed(0)
    model = Transformer(ModelConfig())
    mesh = init_device_mesh("cpu", (1,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = []  # registered after FSDP's own pre-forward hook: sees what the block's forward gets
    model.layers[0].register_forward_pre_hook(lambda module, args: seen.append([a.dtype for a in args]))
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)
    loss.backward()
    assert seen == [[torch.bfloat16, torch.float32, torch.float32]]  # x from the bf16 embedding; cos, sin fp32
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g.full_tensor()).all() for g in grads)


def test_fsdp_prefetches_the_next_blocks_and_keeps_the_last_gathered_without_changing_a_step(one_rank_gloo, monkeypatch):
    """On a 1-rank gloo group: each unit asks FSDP2 (its public API, recorded on the way
    through) to prefetch the next `prefetch` units in forward and the previous ones in
    backward, the last unit is sharded to keep its parameters after forward, and a training
    step gives the gradients FSDP's own order gives, bit for bit."""
    from types import SimpleNamespace

    import torch
    import torch.distributed.fsdp as fsdp
    from torch.distributed.device_mesh import init_device_mesh

    asked = {"forward": {}, "backward": {}, "reshard_after_forward": []}

    def recorded(direction):
        real = getattr(fsdp.FSDPModule, f"set_modules_to_{direction}_prefetch")

        def record(unit, modules):
            asked[direction][id(unit)] = [id(m) for m in modules]
            return real(unit, modules)
        return record

    real_fully_shard = fsdp.fully_shard

    def fully_shard(module, **kwargs):
        asked["reshard_after_forward"].append((id(module), kwargs.get("reshard_after_forward", True)))
        return real_fully_shard(module, **kwargs)

    monkeypatch.setattr(fsdp.FSDPModule, "set_modules_to_forward_prefetch", recorded("forward"))
    monkeypatch.setattr(fsdp.FSDPModule, "set_modules_to_backward_prefetch", recorded("backward"))
    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)

    from ciuic_train.distributed.data_parallel import shard_with_fsdp
    from ciuic_train.model import ModelConfig, Transformer

    device_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    mesh = SimpleNamespace(shape=SimpleNamespace(ep=1), dense=lambda: device_mesh)
    grads = []
    for prefetch, keep in ((0, False), (2, True)):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(n_layers=3, n_dense_layers=1, n_mtp_layers=1))
        asked["forward"].clear(), asked["backward"].clear(), asked["reshard_after_forward"].clear()
        shard_with_fsdp(model, mesh, bf16=False, roots=[model], prefetch=prefetch, keep_last_gathered=keep)
        ids = [id(unit) for unit in [*model.layers, *model.mtp]]
        forward = [asked["forward"].get(i, []) for i in ids]
        backward = [asked["backward"].get(i, []) for i in ids]
        reshard = dict(asked["reshard_after_forward"])
        assert list(reshard) == [*ids, id(model)]  # each unit, then the root
        kept = [not reshard[i] for i in ids]
        if prefetch:
            assert forward == [ids[1:3], ids[2:4], ids[3:4], []]
            assert backward == [[], ids[0:1], ids[1::-1], ids[2:0:-1]]
            assert kept == [False, False, False, True]
        else:
            assert forward == backward == [[]] * 4 and not any(kept)
        idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        model(idx, idx).backward()
        grads.append([p.grad.full_tensor() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_rank_that_hangs_on_its_way_out_prints_every_stack_and_exits_1():
    """What `Parallel.close` arms in a rank's process: a hang after the run (a stuck thread
    or destructor) ends with the stacks that show where, not a process that never exits."""
    code = ("import threading\nfrom ciuic_train.distributed.process_group import exit_within\n"
            "exit_within(1)\nthreading.Event().wait()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "Timeout (0:00:01)!" in result.stderr
    assert 'File "<string>", line 4 in <module>' in result.stderr, result.stderr


def test_the_straggler_rule_warns_once_a_rank_is_slowest_on_enough_logged_steps_in_a_row(caplog):
    """`StepTimes.watch` on given figures (3 ranks, factor 1.5, 3 windows): a streak is one
    rank over 1.5x the others' median on consecutive logged steps; another rank, or a step
    under the factor, starts it again; rank 0 warns once per streak, naming the rank's host."""
    import logging
    from types import SimpleNamespace

    from ciuic_train.config import TrainConfig
    from ciuic_train.train.stragglers import StepTimes

    hosts = ["a 10.0.0.1", "b 10.0.0.2", "c 10.0.0.3"]
    times = StepTimes(TrainConfig(straggler_factor=1.5, straggler_windows=3),
                      SimpleNamespace(is_main=True, addresses=hosts))
    steps = [  # (slowest, busy); 1.5 x the median of the others' is the bar
        (1, [1.0, 1.6, 1.1]), (1, [1.0, 1.7, 1.0]), (2, [1.0, 1.0, 1.6]),  # rank 2 breaks rank 1's streak
        (1, [1.0, 1.6, 1.0]), (1, [1.0, 1.4, 1.0]),  # under the bar: no streak
        (1, [1.0, 1.6, 1.0]), (1, [1.0, 1.6, 1.0]), (1, [1.0, 1.6, 1.0]),  # three in a row: warned
        (1, [1.0, 1.6, 1.0]), (1, [1.0, 1.6, 1.0]),  # the same streak goes on: not again
    ]
    warned_after = []
    for number, (slowest, busy) in enumerate(steps, 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ciuic_train"):
            times.watch(slowest, busy, data=[0.0, 0.25, 0.0])
        warned_after += [number] * len(caplog.records)
        if caplog.records:
            message = caplog.records[0].getMessage()
    assert warned_after == [8]
    assert message.startswith("rank 1 (b 10.0.0.2) is a straggler: on 3 logged steps in a row")
    assert "1.600 s against 1.000 s, 0.250 s of it fetching data" in message


@pytest.mark.slow
def test_a_slowed_rank_is_named_a_straggler_and_each_rank_writes_its_profiler_trace(tmp_path, text_corpus,
                                                                                 monkeypatch):
    """Rank 1 sleeps 0.4 s in each step (`fault.slow_rank`) before the step's agreement:
    metrics.jsonl shows it as the slowest on every logged step, its time holds the sleep,
    and rank 0 warns exactly where the rule (tested above) puts a warning on the logged
    figures, naming rank 1's host; the profiler writes one trace per rank of the same two
    steps. No assertion on how fast the other rank was: that is the machine's. The fp32
    GEMM backend is pinned, so no rank measures it inside a step."""
    import socket

    run_dir = tmp_path / "run"
    monkeypatch.setenv("CIUIC_FP32_GEMM", "mkl")
    result = torchrun(
        "--nproc_per_node=2", "-m", "ciuic_train", *TINY, *corpus_args(text_corpus, tmp_path), "train.max_steps=6",
        "train.log_every=1", "fault.slow_rank=1", "fault.slow_s=0.4", "train.straggler_windows=3",
        "profile.enabled=true", "profile.wait=1", "profile.warmup=1", "profile.active=2", f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["slowest_rank"] for line in lines] == [1] * 6
    assert all(line["step_s_max"] >= 0.4 and line["step_s_min"] < line["step_s_max"] for line in lines), lines
    streak, expected = 0, []
    for line in lines:  # two ranks: the others' median is the fastest rank's time
        streak = streak + 1 if line["step_s_max"] > 1.5 * line["step_s_min"] else 0
        expected += [line["step"]] * (streak == 3)
    warnings = [line for line in (run_dir / "train.log").read_text().splitlines() if "is a straggler" in line]
    assert len(warnings) == len(expected), (warnings, lines)
    for warning in warnings:
        assert f"rank 1 ({socket.gethostname()} " in warning and "3 logged steps in a row" in warning, warning
    for rank in (0, 1):
        (trace,) = (run_dir / "profile").glob(f"rank{rank}.*.pt.trace.json")
        names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3"} <= names
        assert any(str(name).startswith("aten::") for name in names)
