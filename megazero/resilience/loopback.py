"""The launcher's stores listen on the address they are given, never on every interface.

torchrun's agent serves TCP stores (the c10d rendezvous store, the store its workers share) and
``scripts/launch.py`` one more (the join before torchrun, :mod:`megazero.resilience.join`); a
``TCPStore`` server listens on every interface whatever host name it is given, so a launch exposes
unauthenticated key-value stores to the network, and torchrun has no option to bind them.
:func:`serve_on_given_address` makes every store server this process creates listen on one address,
by handing ``TCPStore`` a socket bound there (``master_listen_fd``):

* on one host (:func:`single_host`): 127.0.0.1, and the workers are told to connect there
  (``--local-addr 127.0.0.1``);
* over several nodes: the address of the host name the store is served under (the rendezvous
  host, ``--master-addr``, for the rendezvous and join stores; this node's ``--local-addr``, else its
  fully qualified name, for the workers' store), resolved on this machine (:func:`listen_address`).
  A rendezvous host that is a loopback address means every node is on this host: ``--local-addr``
  defaults to it.  A host *name* that resolves to loopback addresses only (Debian maps the machine's
  own name to 127.0.1.1) cannot be what the other nodes reach: that store listens on every interface,
  as torchrun's does, with one warning line (give the address as an IP to bind it).
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Callable, Optional

LOOPBACK = "127.0.0.1"
LOCAL_NAMES = ("localhost", LOOPBACK, "::1", "")
STORE_ARGS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant",
              "master_listen_fd", "use_libuv")


def rendezvous_host(args) -> str:
    """The rendezvous host of torchrun's parsed ``args``: the c10d endpoint's host, else --master-addr."""
    if getattr(args, "rdzv_backend", "static") == "static" or not getattr(args, "rdzv_endpoint", ""):
        return getattr(args, "master_addr", None) or LOOPBACK
    return (getattr(args, "rdzv_endpoint", "") or "").rsplit(":", 1)[0].strip("[]")


def single_host(args) -> bool:
    """Whether torchrun's parsed ``args`` launch on this host alone: ``--standalone``, or one node
    whose rendezvous (c10d endpoint, or static master address) is this host's loopback."""
    if getattr(args, "standalone", False):
        return True
    if str(getattr(args, "nnodes", "1")) not in ("1", "1:1"):
        return False
    return rendezvous_host(args) in LOCAL_NAMES


def _ip(text: str):
    try:
        return ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return None


def listen_address(host: str) -> Optional[str]:
    """The address a store served under ``host`` listens on: ``host`` itself when it is an IP address,
    else the first address it resolves to here that is not a loopback one (a loopback one for
    ``localhost``); None (every interface) for a name that resolves to loopback addresses only, or
    not at all."""
    if _ip(host) is not None:
        return str(_ip(host))
    try:
        found = [info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        return None
    found = sorted(dict.fromkeys(found), key=lambda a: _ip(a).version if _ip(a) else 9)  # IPv4 first
    outward = [a for a in found if _ip(a) is not None and not _ip(a).is_loopback]
    if outward:
        return outward[0]
    return found[0] if found and host in LOCAL_NAMES else None


def bound_store_class(base, address: Optional[str] = None, warn: Optional[Callable[[str], None]] = None):
    """A subclass of ``base`` (``TCPStore``) whose server listens on ``address``, or (None) on the
    :func:`listen_address` of the host name it is given; clients as before.  A port that cannot be
    bound there falls back to ``base``'s own server, and its errors."""
    warned = set()

    class BoundTCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(STORE_ARGS, args))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                host = str(kwargs.get("host_name") or "")
                where = address or listen_address(host)
                if where is None and warn is not None and host not in warned:
                    warned.add(host)
                    warn(f"warning: {host} resolves to no address of this machine that other nodes can reach "
                         "(only loopback ones, or none): its store listens on every interface; give the "
                         "address as an IP (--master-addr, --local-addr) to bind it")
                if where is not None:
                    self._bind(kwargs, where)
            super().__init__(**kwargs)

        @staticmethod
        def _bind(kwargs, where: str) -> None:
            family = socket.AF_INET6 if ":" in where else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((where, int(kwargs.get("port") or 0)))
                sock.listen(socket.SOMAXCONN)
                kwargs["port"] = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns it from here
            except OSError:
                sock.close()

    return BoundTCPStore


def loopback_store_class(base):
    """A subclass of ``base`` (``TCPStore``) whose server listens on 127.0.0.1 only."""
    return bound_store_class(base, LOOPBACK)


def _install(store) -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend
    dist.TCPStore = store  # the agent's stores: dynamic rendezvous, torch.distributed.elastic.utils, join
    c10d_rendezvous_backend.TCPStore = store  # the c10d rendezvous backend's (imported by name)


def serve_on_loopback(args) -> None:
    """For a single-host launch (``args``: torchrun's parsed arguments): the stores this process
    serves listen on 127.0.0.1, and the workers are told to connect there (``--local-addr``)."""
    import torch.distributed as dist
    args.local_addr = args.local_addr or LOOPBACK
    _install(loopback_store_class(dist.TCPStore))


def serve_on_given_address(args, warn: Optional[Callable[[str], None]] = None) -> None:
    """Every store this process serves listens on the address it is given (module docstring)."""
    import torch.distributed as dist
    if single_host(args):
        serve_on_loopback(args)
        return
    host = _ip(rendezvous_host(args))
    if host is not None and host.is_loopback and not args.local_addr:
        args.local_addr = str(host)  # a rendezvous on this host's loopback: every node is on this host
    _install(bound_store_class(dist.TCPStore, None, warn))
