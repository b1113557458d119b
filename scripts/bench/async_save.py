"""Step time with and without ``--async-save`` (``scripts/bench_checkpoint.py --async-steps``).

One process trains a model whose checkpoint takes longer to write than a step (by default 4 layers of
hidden size 768 and a 32,000-token vocabulary: ~53M parameters, ~640 MB of fp32 master weights and
Adam moments, against a step of one 64-token sample), saving every ``--save-interval`` iterations,
once with synchronous saves and once with ``--async-save``.  The wall time of each iteration (from
one progress line to the next, saves included) is taken from the log stream.  Reported: the median
step without a save, the mean step of the iterations that contain a save (synchronous: the whole
write; asynchronous: the snapshot), and the mean step of the iterations that run while the
background write is in flight, with its ratio to the median step.  The two runs' checkpoints are
compared file by file (the shard data and RNG files must be equal bytes).
"""
import os
import re
import shutil
import statistics
import tempfile
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Clock:
    """A log stream that timestamps every line."""

    def __init__(self):
        self.lines = []

    def write(self, text):
        now = time.perf_counter()
        for line in text.splitlines():
            if line.strip():
                self.lines.append((now, line))

    def flush(self):
        pass


def _run(args, directory, async_save):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import models
    from megazero.config import config_from_dict, validate
    from megazero.training import train
    settings = {"mock_data": True, "num_layers": args.layers, "hidden_size": args.hidden,
                "num_attention_heads": max(1, args.hidden // 64), "vocab_size": 32000, "seq_length": 64,
                "micro_batch_size": 1, "global_batch_size": 1, "optimizer": "adam", "lr": 1e-4,
                "train_iters": args.iters, "save": directory, "save_interval": args.save_interval,
                "log_interval": 1, "async_save": async_save}
    cfg = validate(config_from_dict(settings, models.PRESETS), 1)
    clock = _Clock()
    train(cfg, models.build_chunks, stream=clock, keep_history=False)
    return clock.lines


def _steps(lines):
    """``{iteration: wall seconds since the previous progress line}`` and the iterations (by number)
    with a save in them and during a background write."""
    marks, saving, during, writing = {}, set(), set(), False
    last_it = 0
    for t, line in lines:
        m = re.match(r"iteration +(\d+)/", line)
        if m:
            it = int(m.group(1))
            marks[it] = t
            last_it = it
            if writing:
                during.add(it)
        elif line.startswith("saving checkpoint"):
            saving.add(last_it + 1)  # the snapshot delays the next progress line
            writing = True
        elif line.startswith("saved checkpoint"):
            saving.add(last_it + 1) if "background" not in line else None
            writing = False
    its = sorted(marks)
    wall = {b: marks[b] - marks[a] for a, b in zip(its, its[1:])}
    return wall, saving & set(wall), (during - saving) & set(wall)


def async_steps(args):
    directory = args.dir or tempfile.mkdtemp(prefix="megazero-bench-async-")
    try:
        out = {}
        for mode in (False, True):
            where = os.path.join(directory, "async" if mode else "sync")
            wall, saving, during = _steps(_run(args, where, mode))
            plain = [w for it, w in wall.items() if it not in saving and it not in during and it > 2]
            out[mode] = (statistics.median(plain), [wall[i] for i in sorted(saving)],
                         [wall[i] for i in sorted(during)])
        same = _same_files(os.path.join(directory, "sync"), os.path.join(directory, "async"))
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.layers} layers x {args.hidden} hidden, vocabulary 32000, one 64-token sample per step, "
          f"--save-interval {args.save_interval}, {args.iters} iterations, one process")
    print(f"{'mode':<6} {'median step s':>14} {'step with save s':>17} {'steps during write':>19} "
          f"{'ratio':>6}")
    for mode, (median, saving, during) in out.items():
        mean_during = statistics.mean(during) if during else float("nan")
        print(f"{'async' if mode else 'sync':<6} {median:>14.3f} {statistics.mean(saving):>17.3f} "
              f"{mean_during:>12.3f} (n={len(during):>2}) {mean_during / median:>6.2f}")
    print(f"checkpoints: shard data and RNG files {'bitwise equal' if same else 'DIFFER'}")
    from megazero.errors import EXIT_OK
    return EXIT_OK


def _same_files(a, b):
    for it in sorted(n for n in os.listdir(a) if n.startswith("iter_")):
        for name in os.listdir(os.path.join(a, it)):
            if name.endswith((".bin", ".pt")):
                with open(os.path.join(a, it, name), "rb") as x, open(os.path.join(b, it, name), "rb") as y:
                    if x.read() != y.read():
                        return False
    return True
