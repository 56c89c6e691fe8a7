"""`python -m jax_ep.bench --processes N ...`: the benchmark over N processes of this
machine, one device each, joined by jax.distributed; how the internode modes run (one
NVSHMEM PE per process) and how `--mode internode|hierarchical|internode_low_latency`
is timed (N = --ranks unless --processes says otherwise).

    python -m jax_ep.bench --mode hierarchical --ranks 16 --gpus-per-node 8 ...
    python -m jax_ep.bench --processes 2 --ranks 2 --backends reference --quick  # CPU

Each process runs the single-process benchmark (jax_ep.bench, or jax_ep.bench.low_latency
for internode_low_latency) over the global mesh of all processes' devices and writes its
own JSON; this launcher merges them into the same JSON as the single-process command,
where each result's `median_s` is the slowest process's median (a collective op ends
when its last rank does) and `launch` holds every process's medians. Processes on a
machine with GPUs take GPU `process % GPUs` (several processes share a GPU when there are
fewer GPUs than processes: CUDA MPS shares are set, NVSHMEM stays on this node); without
GPUs (or with --platform cpu) they run on one CPU device each, with gloo collectives.

On several machines, start the worker (jax_ep/bench/worker.py) yourself in every
process (srun, mpirun, ...), then merge:

    python -m jax_ep.bench.worker --process-id I --num-processes N \\
        --coordinator HOST:PORT --out DIR --kind normal -- <bench arguments>
    python -m jax_ep.bench.launch merge --out DIR --num-processes N --json merged.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

# --mode -> (worker kind, NVSHMEM PEs, JAX_EP_INTERNODE_MODE or None)
MODES = {"normal": ("normal", False, None), "low_latency": ("low_latency", False, None),
         "internode": ("normal", True, "direct"),
         "hierarchical": ("normal", True, "hierarchical"),
         "internode_low_latency": ("low_latency", True, None)}
DEFAULT_TIMEOUT_S = 1800.0


def _pop(argv: list[str], flag: str, default=None):
    """Removes `flag VALUE` or `flag=VALUE` from argv; returns VALUE (or default)."""
    for i, a in enumerate(argv):
        if a == flag:
            if i + 1 >= len(argv):
                raise SystemExit(f"jax_ep.bench: {flag} needs a value")
            v = argv[i + 1]
            del argv[i:i + 2]
            return v
        if a.startswith(flag + "="):
            del argv[i]
            return a.split("=", 1)[1]
    return default


def arg_value(argv: list[str], flag: str, default=None):
    """The value of `flag` in argv without removing it."""
    rest = list(argv)
    return _pop(rest, flag, default)


def local_gpus() -> int:
    """GPUs this machine shows (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), without
    starting JAX or CUDA in this process."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        return len([d for d in vis.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def worker_env(*, processes: int, gpus: int, nvshmem: bool, internode_mode,
               gpus_per_node, platform: str, environ=None) -> dict:
    """The workers' environment (jax_ep._src.launch.process_env): the internode mode and node
    size, NVSHMEM on this machine only, and for processes sharing a GPU their CUDA MPS
    share (jax_ep._src.launch.mps_share) with NCCL off for NVSHMEM (it cannot share a GPU)."""
    from jax_ep._src.launch import mps_share, process_env

    env = process_env(environ)
    if nvshmem:
        env.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")  # one machine: peer to peer
    if internode_mode is not None:
        env["JAX_EP_INTERNODE_MODE"] = internode_mode
    if gpus_per_node is not None:
        env["JAX_EP_GPUS_PER_NODE"] = str(gpus_per_node)
    if platform == "gpu" and gpus and processes > gpus:
        mps_share(env, -(-processes // gpus))
        env.setdefault("NVSHMEM_DISABLE_NCCL", "1")
    return env


def launch_main(argv: list[str], *, validate=None, table=None) -> dict:
    """The parent: starts the processes, waits (one deadline), merges their JSON.
    validate(kind, argv): raises on the bench's own argument errors (before any process
    starts); table(report): the merged normal-mode table to print. jax_ep.bench passes
    both, so this module imports neither benchmark (the workers do:
    jax_ep/bench/worker.py)."""
    from jax_ep._src.launch import free_port, run_workers

    argv = list(argv)
    mode = _pop(argv, "--mode", "normal")
    if mode not in MODES:
        raise SystemExit(f"jax_ep.bench: --mode must be one of {', '.join(MODES)}, got "
                         f"{mode!r}")
    kind, nvshmem, internode_mode = MODES[mode]
    ranks = int(arg_value(argv, "--ranks", "8"))
    processes = int(_pop(argv, "--processes", str(ranks)))
    gpus_per_node = _pop(argv, "--gpus-per-node")
    platform = _pop(argv, "--platform", "auto")
    timeout_s = float(_pop(argv, "--launch-timeout", str(DEFAULT_TIMEOUT_S)))
    json_path = _pop(argv, "--json")
    log_dir = _pop(argv, "--log-dir")
    if processes < 1:
        raise SystemExit(f"jax_ep.bench: --processes must be >= 1, got {processes}")
    if ranks != processes:
        raise SystemExit(f"jax_ep.bench: --processes {processes} runs one rank per process; "
                         f"--ranks is {ranks}: give them equal")
    if gpus_per_node is not None and (not gpus_per_node.isdigit() or int(gpus_per_node) < 1
                                      or processes % int(gpus_per_node)):
        raise SystemExit(f"jax_ep.bench: --gpus-per-node must divide --processes "
                         f"{processes}, got {gpus_per_node}")
    if platform not in ("auto", "cpu", "gpu"):
        raise SystemExit(f"jax_ep.bench: --platform must be auto, cpu or gpu, got {platform!r}")
    if validate is not None:
        validate(kind, argv)  # the bench's own argument errors, here, not in N processes
    gpus = local_gpus() if platform != "cpu" else 0
    if platform == "auto":
        platform = "gpu" if gpus else "cpu"
    if platform == "gpu" and not gpus:
        raise SystemExit("jax_ep.bench: --platform gpu, but this machine shows no GPU "
                         "(CUDA_VISIBLE_DEVICES / nvidia-smi -L)")
    if nvshmem:
        import jax_ep
        info = jax_ep.build_info()
        if platform != "gpu" or not info.get("nvshmem"):
            raise NotImplementedError(
                f"jax_ep.bench --mode {mode}: the internode modes run one NVSHMEM PE per "
                f"process on GPUs; here the platform is {platform!r} and the build has "
                f"nvshmem={info.get('nvshmem')} (build_info()). Their kernels are counted "
                "on the emulated GPU by `python -m jax_ep.bench --emulated --modes "
                "direct,hierarchical,internode_ll`.")
        if arg_value(argv, "--backends") is None:
            argv += ["--backends", "internode"]
    # the processes' logs and JSON: kept in --log-dir; a temporary folder otherwise, removed
    # once merged and kept (its path printed) when a process fails or hangs
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        stale = [f for f in os.listdir(log_dir) if f.startswith("proc") and f.endswith(".json")]
        if stale:
            raise SystemExit(f"jax_ep.bench: --log-dir {log_dir} already holds {sorted(stale)} "
                             "from an earlier run; give an empty folder")
    out = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="jax_ep_bench_")
    port = free_port()
    env = worker_env(processes=processes, gpus=gpus, nvshmem=nvshmem,
                     internode_mode=internode_mode,
                     gpus_per_node=gpus_per_node, platform=platform)
    argvs = [[sys.executable, "-m", "jax_ep.bench.worker", "--process-id",
              str(i), "--num-processes", str(processes), "--coordinator",
              f"localhost:{port}", "--out", out, "--kind", kind, "--platform", platform,
              "--local-device", str(i % gpus if gpus else 0), "--"] + argv
             for i in range(processes)]
    print(f"jax_ep.bench: {processes} processes ({platform}"
          + (f", {gpus} GPU(s)" if platform == "gpu" else "")
          + (f", mode {mode}" if mode != "normal" else "") + f"), logs in {out}"
          + ("" if log_dir is not None else " (removed after a successful run)"),
          file=sys.stderr)
    procs, hung, logs = run_workers(out, argvs, env, timeout_s, tail=4000)
    if hung:
        raise SystemExit(f"jax_ep.bench: processes {hung} still ran after {timeout_s:.0f} s "
                         f"(--launch-timeout) and were killed; logs in {out}\n{logs}")
    report = merge(out, processes, logs=logs)
    report["launch"].update(mode=mode, platform=platform, gpus=gpus,
                            internode_mode=internode_mode, gpus_per_node=gpus_per_node,
                            log_dir=log_dir)
    if log_dir is None:
        shutil.rmtree(out, ignore_errors=True)
    _print(report, kind, table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {json_path}")
    return report


def merge(out: str, processes: int, logs: str = "") -> dict:
    """One report from the processes' proc<i>.json: process 0's, with every result's
    median_s the slowest process's median (GB/s from it) and min_s / max_s over all."""
    reports = []
    for i in range(processes):
        path = os.path.join(out, f"proc{i}.json")
        if not os.path.exists(path):
            raise SystemExit(f"jax_ep.bench: process {i} wrote no result ({path})\n{logs}")
        with open(path) as f:
            reports.append(json.load(f))
    failed = {i: r["error"] for i, r in enumerate(reports) if "error" in r}
    if failed:
        first = min(failed)
        raise SystemExit(f"jax_ep.bench: {len(failed)} of {processes} processes failed "
                         f"(logs in {out}); process {first}: {failed[first]}")
    report = reports[0]
    keyed = [{(r["backend"], r["op"]): r for r in rep["results"]} for rep in reports]
    if any(set(k) != set(keyed[0]) for k in keyed):
        raise SystemExit("jax_ep.bench: the processes timed different (backend, op) pairs: "
                         f"{[sorted(k) for k in keyed]}")
    per_process = []
    for r in report["results"]:
        key = (r["backend"], r["op"])
        meds = [k[key]["median_s"] for k in keyed]
        per_process.append({"backend": key[0], "op": key[1], "median_s": meds})
        r["median_s"] = max(meds)
        r["min_s"] = min(k[key].get("min_s", k[key]["median_s"]) for k in keyed)
        r["max_s"] = max(k[key].get("max_s", k[key]["median_s"]) for k in keyed)
        if "bytes" in r and "GBps" in r:
            r["GBps"] = r["bytes"] / r["median_s"] / 1e9
    report["launch"] = {"processes": processes, "median_s_per_process": per_process,
                        "median_s": "the slowest process's median of its own timed calls"}
    return report


def _print(report: dict, kind: str, table=None) -> None:
    if kind == "normal" and table is not None:
        print(table(report))
    else:
        for r in report["results"]:
            print(f"{r['backend']:>9} {r['op']:>13}: median {r['median_s'] * 1e3:9.2f} ms "
                  "(slowest process)")
        for b, why in report.get("skipped_backends", {}).items():
            print(f"{b:>9} skipped: {why}")
    print(f"{report['launch']['processes']} processes; median_s per result: the slowest "
          "process's median")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["merge"]:
        p = argparse.ArgumentParser(prog="python -m jax_ep.bench.launch merge")
        p.add_argument("--out", required=True)
        p.add_argument("--num-processes", type=int, required=True)
        p.add_argument("--json", required=True)
        a = p.parse_args(argv[1:])
        report = merge(a.out, a.num_processes)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.json}")
        return 0
    raise SystemExit("python -m jax_ep.bench.launch merge --out DIR --num-processes N "
                     "--json PATH merges the workers' reports; to launch, run "
                     "python -m jax_ep.bench --processes N ...")


if __name__ == "__main__":
    sys.exit(main())
