"""The ``criu`` engine of the live backend: checkpoint a workspace's process tree with Debian's
``criu`` to a tmpfs and restore it into a new container shell (the baseline the ``bunshin``
engine is measured against).

Not finished: :meth:`_Criu.find` refuses the engine with a :class:`ConfigError` that says why
(see ``docs/engines-live.md``). The mount namespace of a workspace (an overlay root over the
host root, a private /dev with bind-mounted device nodes, devpts, sysfs) needs criu's external
mounts and ``--root`` handled, and the agent's channel to the controller an ``--ext-unix-sk``
dump and an ``--inherit-fd`` restore; none of that is done yet.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ._exceptions import ConfigError

if TYPE_CHECKING:
    from ._container import Container

__all__: list[str] = []


class _Criu:
    """Dump and restore through the ``criu`` program."""

    def __init__(self, binary: str) -> None:
        self.binary = binary

    @classmethod
    def find(cls) -> _Criu:
        binary = shutil.which("criu") or ("/usr/sbin/criu" if Path("/usr/sbin/criu").exists() else None)
        if binary is None:
            raise ConfigError("the criu engine needs criu (apt-get install -y criu)")
        raise ConfigError("the criu engine of the live backend is not finished (the workspace's mount namespace "
                          "and the agent's channel are not handled yet); use engine='bunshin' or 'restart'")

    def new_image_dir(self) -> Path:
        raise NotImplementedError

    def dump(self, container: Container, image: Path) -> None:
        raise NotImplementedError

    async def restore(self, image: Path, shell: Container) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass
