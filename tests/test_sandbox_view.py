"""The code sandbox's view of the machine: nothing outside the work dir can be changed, the disk use is
capped, and no unix socket is reachable."""

from __future__ import annotations

import os
import socket

import pytest

from mlx_ssp.verify.sandbox import Limits, run_python

from sandbox_helpers import L, _view_enforced


@pytest.fixture
def open_dir():
    """A directory anyone can reach and write (tmp_path's parents are private)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="mlx_ssp_open_", dir="/tmp" if os.path.isdir("/tmp") else None)
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_only_the_work_dir_is_writable(open_dir):
    """Every mount but the work dir's is read-only, so /tmp, /dev/shm, /var/tmp, /run and any
    world-writable file outside are out of reach (they do not even exist inside)."""
    if not _view_enforced():
        pytest.skip("no filesystem view without root (documented)")
    victim = os.path.join(open_dir, "world_writable.txt")
    with open(victim, "w") as f:
        f.write("keep")
    os.chmod(victim, 0o666)
    tag = f"mlx_ssp_escape_{os.getpid()}"
    outside = [f"/tmp/{tag}", f"/dev/shm/{tag}", f"/var/tmp/{tag}", f"/run/{tag}", f"/{tag}", f"/etc/{tag}"]
    targets = outside + [victim, os.path.join(open_dir, "new.txt")]
    code = (
        "import os\n"
        f"for p in {targets!r}:\n"
        "    try:\n        open(p, 'a').write('x' * 1000)\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('denied', p, e.errno)\n"
        "open('inside.txt', 'w').write('ok')\n"
        "open('/dev/null', 'w').write('discarded')\n"
        "mounts = [l.split() for l in open('/proc/self/mountinfo')]\n"
        "for m in mounts:\n"
        "    if m[4] != '/sandbox' and not m[4].startswith('/proc') and 'ro' not in m[5].split(','):\n"
        "        print('WRITABLE MOUNT', m[4], m[5])\n"
        "print('cwd', os.getcwd())\n"
    )
    try:
        r = run_python(code, L)
        assert r.ok, r
        assert "WROTE" not in r.stdout and "WRITABLE MOUNT" not in r.stdout, r.stdout
        assert r.stdout.count("denied") == len(targets) and "cwd /sandbox" in r.stdout, r.stdout
        with open(victim) as f:
            assert f.read() == "keep"
        assert not os.path.exists(targets[-1])
        assert not any(os.path.exists(p) for p in outside)
    finally:
        for p in outside:
            if os.path.isfile(p):
                os.unlink(p)


def test_total_disk_use_is_capped():
    """Many files each under the file-size limit still stop at the work dir's size (tmpfs_mb)."""
    if not _view_enforced():
        pytest.skip("no size-capped work dir without root (documented)")
    lim = Limits(wall_s=8, cpu_s=4, fsize_mb=4, tmpfs_mb=8)
    tag = f"mlx_ssp_fill_{os.getpid()}"
    code = (
        "import errno\nn = 0\n"
        "try:\n"
        "    for i in range(100):\n"
        "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n        n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno == errno.ENOSPC)\n"
        f"for d in ('/tmp', '/dev/shm', '/var/tmp'):\n"  # and no other place takes more
        "    try:\n"
        f"        with open(d + '/{tag}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
        "        print('ESCAPED', d)\n"
        "    except OSError:\n        pass\n"
    )
    try:
        r = run_python(code, lim)
    finally:
        for d in ("/tmp", "/dev/shm", "/var/tmp"):
            if os.path.isfile(f"{d}/{tag}"):
                os.unlink(f"{d}/{tag}")
    assert r.ok and r.stdout.split()[0] == "stopped", r
    assert int(r.stdout.split()[1]) < 8 and r.stdout.split()[2] == "True", r.stdout
    assert "ESCAPED" not in r.stdout, r.stdout


def test_no_unix_socket_is_reachable(open_dir):
    """World-writable listening sockets in /tmp, /dev/shm, /run, a user dir, and an abstract one:
    the program reaches none (no file of them exists inside; abstract names are per network
    namespace)."""
    if not _view_enforced():
        pytest.skip("Unix sockets are reachable without root (documented)")
    tag = f"mlx_ssp_sock_{os.getpid()}"
    paths = [f"/tmp/{tag}", f"/dev/shm/{tag}", f"/run/{tag}", os.path.join(open_dir, "s")]
    servers = []
    try:
        for p in paths:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(p)
            os.chmod(p, 0o777)
            s.listen(4)
            s.setblocking(False)
            servers.append(s)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0" + tag)
        s.listen(4)
        s.setblocking(False)
        servers.append(s)
        code = (
            "import socket\n"
            f"for p in {paths + [chr(0) + tag]!r}:\n"
            "    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "    try:\n        c.connect(p)\n        print('CONNECTED', repr(p))\n"
            "    except OSError as e:\n        print('refused', e.errno)\n"
        )
        r = run_python(code, L)
        assert r.ok and "CONNECTED" not in r.stdout and r.stdout.count("refused") == len(paths) + 1, r
        for s in servers:
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in servers:
            s.close()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)
