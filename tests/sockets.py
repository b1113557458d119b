"""Which addresses TCP sockets listen on, read from /proc/net/tcp and tcp6 (Linux), for the tests that
check a store or launcher binds the address it was given and no other."""
import ipaddress
import os


def address(hex_addr: str) -> str:
    """/proc/net/tcp's address (IPv4: one little-endian word; IPv6: four) as text."""
    words = [bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8)]
    return str(ipaddress.ip_address(b"".join(words)))


def _socket_inodes(pid: int) -> set:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def listening(pid=None, port=None):
    """(address, port) of every listening TCP socket, of process ``pid`` only when given and on
    ``port`` only when given."""
    inodes = None if pid is None else _socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for row in open(table).read().splitlines()[1:]:
            f = row.split()
            if f[3] != "0A" or (inodes is not None and f[9] not in inodes):  # 0A: LISTEN
                continue
            addr, hex_port = f[1].split(":")
            if port is None or int(hex_port, 16) == port:
                out.append((address(addr), int(hex_port, 16)))
    return out


def loopback(text: str) -> bool:
    """127.x.x.x or ::1, also as an IPv4-mapped IPv6 address."""
    ip = ipaddress.ip_address(text)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or bool(mapped and mapped.is_loopback)
