#!/usr/bin/env bash
# What tests/test_deepspeed_launch.py's ssh and pdsh runs need: Debian's openssh-server,
# openssh-client and pdsh, installed with apt-get (as root) when missing.  The test starts its own
# sshd on 127.0.0.1 with its own keys; nothing here starts a daemon or changes a configuration.
# Exit status: 0 ready; 3 skipped, with one line `setup_ssh.sh: skipped: <why>` (not root, no
# apt-get); 1 the install failed (apt-get's output shown).
set -euo pipefail
say() { echo "setup_ssh.sh: $*"; }
skip() { say "skipped: $*"; exit 3; }
if [ -x /usr/sbin/sshd ] && command -v ssh >/dev/null && command -v ssh-keygen >/dev/null \
   && command -v pdsh >/dev/null; then
  exit 0
fi
[ "$(id -u)" = 0 ] || skip "not root (apt-get install openssh-server openssh-client pdsh needs it)"
command -v apt-get >/dev/null || skip "no apt-get (install openssh-server, openssh-client and pdsh)"
log="$(mktemp)"
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
     openssh-server openssh-client pdsh >"$log" 2>&1; then
  if ! { apt-get update -q >>"$log" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
         --no-install-recommends openssh-server openssh-client pdsh >>"$log" 2>&1; }; then
    cat "$log" >&2
    rm -f "$log"
    say "apt-get install openssh-server openssh-client pdsh failed"
    exit 1
  fi
fi
rm -f "$log"
