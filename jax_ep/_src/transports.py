"""`transport_report()` (jax_ep.transport_report): which internode transport this process
uses and why, both transports' libraries, and the NVSHMEM wire details."""
from __future__ import annotations

__all__ = ["transport_report"]


def transport_report(config=None, num_peers: int | None = None, *,
                     local_gpus: int | None = None, fabric_class: str | None = None) -> dict:
    """Which internode transport this process uses and why, and what it does on the wire.

    Keys: transport ("nvshmem" | "nccl"), reason (why, in words), setting (the `transport`
    setting: "nvshmem" | "nccl" | "auto"), ready (bool: the chosen transport's library and
    build support are present), missing (str | None: what to install when not ready),
    nvshmem and nccl ({available, version, package, package_version, library_version,
    built, why}; nccl also started, ranks, world once jax_ep.nccl_bootstrap started it),
    build_info (cpu, cuda, nvshmem, nvshmem_qp_api, nccl: bool); and the NVSHMEM wire
    details of jax_ep._src.backends.internode.transport_report (qp_path, ports, qp_map,
    fabric, nvshmem_env, bootstrap_interface, notes, ...). `config`, `num_peers` go to
    that report; local_gpus and fabric_class to choose_transport (None: detected).
    """
    from jax_ep._src import libraries
    from jax_ep._src.backends import internode
    from jax_ep.network.transport_choice import choose_transport

    build = libraries.build_flags()
    nv = libraries.nvshmem_library(build)
    nc = libraries.nccl_library(build)
    from jax_ep import nccl_bootstrap
    st = nccl_bootstrap.state()
    nc.update(started=st is not None, ranks=list(st.ranks) if st else None,
              world=st.world if st else None)
    choice = choose_transport(local_gpus=local_gpus,
                              nvshmem_available=nv["available"] and nv["built"],
                              nvshmem_why=nv["why"] or "", fabric_class=fabric_class)
    chosen = nc if choice.transport == "nccl" else nv
    ready = bool(chosen["available"] and chosen["built"])
    rep = dict(internode.transport_report(config, num_peers))
    rep.update(
        transport=choice.transport, reason=choice.reason, setting=choice.setting,
        ready=ready, missing=None if ready else chosen["why"], nvshmem=nv, nccl=nc,
        build_info={k: bool(build.get(k, False))
                    for k in ("cpu", "cuda", "nvshmem", "nvshmem_qp_api", "nccl")})
    return rep
