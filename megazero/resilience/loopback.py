"""A launch on one host keeps torchrun's stores off the network.

torchrun's agent serves TCP stores (the c10d rendezvous store, the store its workers share); a
``TCPStore`` server listens on every interface whatever host name it is given, so a single-node
run exposes an unauthenticated key-value store to the network.  torchrun has no option to bind
it.  :func:`serve_on_loopback` makes every store server the agent (this process) creates listen
on 127.0.0.1 only, by handing ``TCPStore`` a socket bound there (``master_listen_fd``), and sets
``--local-addr`` to 127.0.0.1 so that the workers connect there.  Only for a launch on one host
(:func:`single_host`); several nodes keep torchrun's behaviour.
"""
from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
LOCAL_NAMES = ("localhost", LOOPBACK, "::1", "")
STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
              "master_listen_fd", "use_libuv")


def single_host(args) -> bool:
    """Whether torchrun's parsed ``args`` launch on this host alone: ``--standalone``, or one node
    whose rendezvous (c10d endpoint, or static master address) is this host's loopback."""
    if getattr(args, "standalone", False):
        return True
    if str(getattr(args, "nnodes", "1")) not in ("1", "1:1"):
        return False
    if getattr(args, "rdzv_backend", "static") == "static":
        host = getattr(args, "master_addr", None) or LOOPBACK
    else:
        host = (getattr(args, "rdzv_endpoint", "") or "").rsplit(":", 1)[0].strip("[]")
    return host in LOCAL_NAMES


def loopback_store_class(base):
    """A subclass of ``base`` (``TCPStore``) whose server listens on 127.0.0.1 only (clients as before;
    a port that cannot be bound there falls back to ``base``'s own server, and its errors)."""

    class LoopbackTCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(STORE_ARGS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((LOOPBACK, int(kwargs.get("port") or 0)))
                    sock.listen(socket.SOMAXCONN)
                    kwargs["port"] = sock.getsockname()[1]
                    kwargs["master_listen_fd"] = sock.detach()  # the store owns it from here
                except OSError:
                    sock.close()
            super().__init__(**kwargs)

    return LoopbackTCPStore


def serve_on_loopback(args) -> None:
    """For a single-host launch (``args``: torchrun's parsed arguments): the stores this process
    serves listen on 127.0.0.1, and the workers are told to connect there (``--local-addr``)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    args.local_addr = args.local_addr or LOOPBACK
    store = loopback_store_class(dist.TCPStore)
    dist.TCPStore = store  # the agent's stores: dynamic rendezvous, torch.distributed.elastic.utils
    c10d_rendezvous_backend.TCPStore = store  # the c10d rendezvous backend's (imported by name)
