"""Test helper: run pixelsac.train, but hang inside the second save of last.ckpt -- after the
new file is written under its temporary name, before it replaces the old one -- and touch a
marker file, so the test can SIGKILL the process mid-save."""

import sys
import time
from pathlib import Path

from marks import write_whole  # this script's folder is on sys.path
from overrides import merged

import pixelsac.callbacks as callbacks

marker = Path(sys.argv[1])
real = callbacks._fsync_and_replace
saves = {"last.ckpt": 0}


def hanging_replace(tmp: Path, path: Path) -> None:
    if path.name == "last.ckpt":
        saves["last.ckpt"] += 1
        if saves["last.ckpt"] == 2:
            write_whole(marker, str(tmp))
            time.sleep(600)
    real(tmp, path)


callbacks._fsync_and_replace = hanging_replace

if __name__ == "__main__":  # env worker processes (env.num_envs > 1, spawned) import this module again
    from pixelsac.train import main

    sys.exit(main(merged(*sys.argv[2:])))
