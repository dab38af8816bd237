"""The lab VM (bunshin_async._vm, ``bunshin vm``) and, through it, the kernel module's in-VM suite.

The tests that boot need root, qemu-system-x86_64, a static busybox, depmod and Debian's kernel
(downloaded with apt into the cache on first use, about 90 MB); without them they are skipped
with the reason. Each boot takes a few seconds under TCG.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bunshin_async import _vm
from bunshin_async._cli import main
from bunshin_async._cmd_vm import vm_suite_argv

ROOT = Path(__file__).resolve().parent.parent


# --- without a VM ------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "expected"), [
    ("6.1.0-56", "6.1.0-56-amd64"),
    ("6.1.0-56-amd64", "6.1.0-56-amd64"),
    ("6.12.38+deb12", "6.12.38+deb12-amd64"),
])
def test_normalize_kernel_version(given: str, expected: str) -> None:
    assert _vm.normalize_kernel_version(given) == expected


@pytest.mark.parametrize("bad", ["", "latest", "6.1", "6.1.0-56-arm64", "6.1.0-56; rm -rf /"])
def test_normalize_kernel_version_rejects(bad: str) -> None:
    with pytest.raises(_vm.VMError, match="invalid kernel version"):
        _vm.normalize_kernel_version(bad)


def test_cpio_newc_layout() -> None:
    """The initramfs writer's archive is what the kernel (and cpio -t) reads."""
    c = _vm._Cpio()
    c.dir("bin")
    c.file("bin/x", b"hello", 0o755)
    data = c.close()
    assert data.startswith(b"070701") and len(data) % 4 == 0
    assert b"bin/x\0" in data and b"hello" in data and b"TRAILER!!!\0" in data
    if shutil.which("cpio"):
        import subprocess

        names = subprocess.run(["cpio", "-t", "--quiet"], input=data, capture_output=True, check=True).stdout
        assert names.decode().split() == ["bin", "bin/x"]


def test_job_script_quotes_arguments() -> None:
    script = _vm._job_script(["/bin/echo", "a b", "$HOME", "'"], "/no such dir", {"X": "1 2"}, None)
    assert "exec /bin/echo 'a b' '$HOME' ''\"'\"''" in script
    assert "export X='1 2'" in script and "cd '/no such dir' 2>/dev/null || cd /" in script


def test_vm_run_without_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vm", "run", "--"]) == 2
    assert "no command given" in capsys.readouterr().err


# --- booting -----------------------------------------------------------------------------------


def _missing() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the lab VM needs root on Linux"
    if _vm.qemu_path() is None:
        return "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"
    try:
        _vm._busybox()
        _vm._which("depmod", "kmod")
    except _vm.VMError as exc:
        return str(exc)
    return None


_REASON = _missing()
needs_vm = pytest.mark.skipif(_REASON is not None, reason=f"lab VM unavailable: {_REASON}")
CACHE = os.environ.get("BUNSHIN_VM_CACHE", _vm.DEFAULT_CACHE_DIR)


@pytest.fixture(scope="module")
def kernel() -> _vm.KernelTree:
    """Debian's kernel in the cache (downloaded on first use), or skip saying why not."""
    try:
        return _vm.ensure_kernel(_vm.default_kernel_version(CACHE), CACHE)
    except _vm.VMError as exc:
        pytest.skip(f"the lab VM's kernel image is missing and could not be fetched: {exc}")


@needs_vm
def test_vm_runs_a_command(kernel: _vm.KernelTree) -> None:
    """Output and status come back; the root is read-only, /tmp is writable; a background process
    that keeps stdout open does not keep the VM up."""
    script = ("echo out; echo err >&2; uname -r; "
              "if touch /usr/bunshin-vm-probe 2>/dev/null; then echo root-writable; fi; "
              "echo x > /tmp/probe && cat /tmp/probe; "
              "/bin/sleep 1000 & exit 7")
    r = _vm.run_vm(["/bin/sh", "-c", script], kernel_version=kernel.version, module=False, timeout=120,
                   cache_dir=CACHE)
    assert r.status == 7
    assert r.stdout.decode().split() == ["out", kernel.version, "x"]
    assert r.stderr == b"err\n"
    assert 0 < r.boot_seconds < 60 and r.wall_seconds < 120
    assert not os.path.exists("/usr/bunshin-vm-probe")


@needs_vm
def test_vm_root_module_requests_and_cpu(kernel: _vm.KernelTree) -> None:
    """The host root is the guest's own root (switch_root, not a chroot: pid 1's root is it,
    where under a chroot it was the initramfs); the kernel's own module requests load the
    image's modules (a dummy link needs ``dummy.ko``); the CPU model runs numpy (qemu64 did not)."""
    numpy = "import numpy; print(numpy.ones(3).sum())"
    script = ("readlink /proc/1/root; echo --; /bin/cat /proc/1/mountinfo; echo --; "
              "/usr/sbin/ip link add bunshin0 type dummy && echo dummy-loaded; echo --; "
              f"{shlex.quote(os.path.realpath(sys.executable))} -c {shlex.quote(numpy)}")
    r = _vm.run_vm(["/bin/sh", "-c", script], kernel_version=kernel.version, module=False, timeout=180,
                   shares=_vm.shares_for(sys.prefix), cwd="/", cache_dir=CACHE)
    assert r.status == 0, r.stderr.decode()
    root, mounts, dummy, py = r.stdout.decode().split("--\n")
    assert root == "/\n"
    top = [ln.split() for ln in mounts.splitlines() if ln.split()[4] == "/"]
    assert len(top) == 1 and top[0][3] == "/" and top[0][top[0].index("-") + 1] == "9p", mounts
    assert dummy == "dummy-loaded\n", r.stderr.decode()
    if importlib.util.find_spec("numpy") is not None:
        assert py == "3.0\n", r.stdout.decode() + r.stderr.decode()


@needs_vm
def test_vm_share_is_writable(kernel: _vm.KernelTree, tmp_path: Path) -> None:
    (tmp_path / "in").write_text("to-guest\n")
    r = _vm.run_vm(["/bin/sh", "-c", f"echo \"$GREETING\" > {tmp_path}/f; /bin/cat {tmp_path}/in; pwd"],
                   kernel_version=kernel.version, module=False, shares=[str(tmp_path)], cwd="/etc",
                   env={"GREETING": "from guest"}, timeout=120, cache_dir=CACHE)
    assert r.status == 0, r.stderr
    assert r.stdout == b"to-guest\n/etc\n"
    assert (tmp_path / "f").read_text() == "from guest\n"


@needs_vm
def test_vm_timeout_kills_qemu(kernel: _vm.KernelTree) -> None:
    with pytest.raises(_vm.VMError, match="did not finish within 15 s"):
        _vm.run_vm(["/bin/sleep", "1000"], kernel_version=kernel.version, module=False, timeout=15,
                   cache_dir=CACHE)


@needs_vm
def test_cli_vm_run_exit_status(kernel: _vm.KernelTree, capfd: pytest.CaptureFixture[str]) -> None:
    status = main(["vm", "run", "-q", "--no-module", "--kernel-version", kernel.version, "--cache-dir", CACHE,
                   "--", "/bin/sh", "-c", "echo hi; exit 3"])
    assert status == 3
    assert capfd.readouterr().out == "hi\n"


@needs_vm
def test_module_suite_in_vm(kernel: _vm.KernelTree, tmp_path: Path) -> None:
    """Build kmod/ against Debian's headers and run tests/vm/ in the VM: all must pass."""
    junit = tmp_path / "junit.xml"
    r = _vm.run_vm(vm_suite_argv(sys.executable, str(ROOT), junit=str(junit)), kernel_version=kernel.version,
                   module=str(ROOT / "kmod"), shares=[str(tmp_path), *_vm.shares_for(str(ROOT), sys.prefix)],
                   timeout=600, cache_dir=CACHE)
    out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
    assert r.status == 0, out[-6000:] + "\n--- guest dmesg ---\n" + r.dmesg[-3000:]
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    assert int(suite.get("failures", 1)) == 0 and int(suite.get("errors", 1)) == 0
    assert int(suite.get("skipped", 1)) == 0
    names = {tc.get("name", "").split("[")[0] for tc in suite.iter("testcase")}
    for must in ("test_device_node", "test_version", "test_unknown_command_is_enotty",
                 "test_caller_without_cap_sys_admin_is_eperm", "test_truncated_argument_is_efault",
                 "test_version_rejects_nonzero_inputs", "test_reload_and_unload_leave_no_warning"):
        assert must in names
    for must in ("test_fork_into_target", "test_source_not_frozen_is_ebusy", "test_multithreaded_source_is_einval",
                 "test_fork_needs_cap_sys_admin", "test_100_forks_then_unload"):  # vm_fork.py: BUNSHIN_IOC_FORK
        assert must in names
    for must in ("test_concurrent_tree_forks_of_one_source", "test_scheduler_replay_on_the_bunshin_engine",
                 "test_criu_fork_keeps_state_isolates_and_copies", "test_criu_dump_refused_cleanly"):
        assert must in names  # vm_tree.py, vm_engine.py, vm_criu.py
    assert "BUG:" not in r.dmesg and "WARNING:" not in r.dmesg
