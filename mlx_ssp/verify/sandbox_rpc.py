"""The sandbox harness's protocol: plain data across the process boundary between the untrusted
program's process and the tests' process, the program's side (:func:`serve`) and the tests' side
(:func:`run_tests`: the trusted namespace, with proxies for the program's names).

Trusted code of the bootstrap (:mod:`mlx_ssp.verify.sandbox_boot`, whose docstring describes harness
mode), in a file of its own: the bootstrap runs it from this path when it starts, before any isolation
step, into a module object it never puts in ``sys.modules``; nothing imports it by name (``python -I``
keeps this directory off ``sys.path``), so a module the program writes cannot stand in for it. It
uses the standard library only.
"""

import json
import os
import sys

INT_RANGE = 1 << 63


def read_all(fd):
    chunks = []
    while True:
        b = os.read(fd, 1 << 16)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]




# -- data across the process boundary ----------------------------------------------------------

def enc(x, other):
    """``x`` as a JSON value, with one-key tags for what JSON lacks; a value that is not plain data
    goes to ``other`` (the program's side: a handle; the tests' side: refused)."""
    t = type(x)
    if t is str or t is bool or x is None:
        return x
    if t is int:
        return x if -INT_RANGE <= x < INT_RANGE else {"i": hex(x)}  # hex: no digit limit
    if t is float:
        return x if x - x == 0.0 else {"f": repr(x)}  # inf, nan
    if t is list:
        return [enc(v, other) for v in x]
    if t is tuple:
        return {"t": [enc(v, other) for v in x]}
    if t is dict:
        return {"d": [[enc(k, other), enc(v, other)] for k, v in x.items()]}
    if t is set or t is frozenset:
        return {"s" if t is set else "z": [enc(v, other) for v in x]}
    if t is complex:
        return {"c": [enc(x.real, other), enc(x.imag, other)]}
    if t is bytes or t is bytearray:
        return {"b" if t is bytes else "y": x.hex()}
    return other(x)


def revive(handle):
    """json object_hook undoing :func:`enc`'s tags; ``handle`` maps a handle tag's value."""
    def hook(o):
        if len(o) != 1:
            raise ValueError("malformed data")
        (k, v), = o.items()
        if k == "t":
            return tuple(v)
        if k == "d":
            return dict(v)
        if k == "s":
            return set(v)
        if k == "z":
            return frozenset(v)
        if k == "c" and all(type(p) in (int, float) for p in v):
            return complex(*v)
        if k in ("b", "y", "i", "f") and type(v) is str:
            if k == "f" and v not in ("inf", "-inf", "nan"):
                raise ValueError("malformed data")
            return {"b": bytes.fromhex, "y": bytearray.fromhex, "i": lambda s: int(s, 16), "f": float}[k](v)
        if k == "h":
            return handle(v)
        raise ValueError("malformed data")
    return hook


# the plain value of a subclass of a plain type (each returns the exact base type)
PLAIN = (
    (int, int.__int__), (float, float.__float__), (str, str.__str__),
    (complex, lambda x: complex(float.__float__(x.real), float.__float__(x.imag))),
    (bytes, lambda x: bytes(memoryview(x))), (bytearray, lambda x: bytearray(memoryview(x))),
    (list, list), (tuple, tuple), (dict, dict), (set, set), (frozenset, frozenset),
)


class Channel:
    """Length-prefixed JSON messages over a pair of pipes."""

    def __init__(self, rfd, wfd, hook):
        self.rfd, self.wfd, self.hook = rfd, wfd, hook

    def send(self, msg):
        data = json.dumps(msg, allow_nan=False, separators=(",", ":")).encode()
        write_all(self.wfd, len(data).to_bytes(4, "big") + data)

    def _exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            b = os.read(self.rfd, min(n - len(buf), 1 << 20))
            if not b:
                return None
            buf += b
        return bytes(buf)

    def recv(self):
        head = self._exact(4)
        body = head and self._exact(int.from_bytes(head, "big"))
        return None if body is None else json.loads(body, object_hook=self.hook)


def serve(chan_fds, g):
    """The program's process after its top level ran: export its names, then answer the tests'
    calls. Whatever it sends is data or a handle; it runs nothing the tests' process would trust."""
    handles = []

    def other(x):
        for base, plain in PLAIN:
            if isinstance(x, base):  # a subclass: its plain value (an always-equal str is just a str)
                return enc(plain(x), other)
        tolist = getattr(type(x), "tolist", None)  # numpy scalars and arrays
        if callable(tolist):
            v = tolist(x)
            if type(v) is not type(x):
                return enc(v, other)
        handles.append(x)
        return {"h": [len(handles) - 1, type(x).__name__[:80]]}

    chan = Channel(chan_fds[0], chan_fds[1], revive(lambda v: handles[v[0]]))
    names = []
    for name, v in list(g.items()):
        if name.startswith("__") or type(v) is type(sys):
            continue
        try:
            big = type(v) in (list, tuple, dict, set, frozenset, str, bytes) and len(v) > 10000
            names.append([name, other(v) if big else enc(v, other)])
        except Exception:
            pass
    chan.send(names)
    while True:
        req = chan.recv()
        if req is None:
            return
        try:
            chan.send(["v", *answer(req, handles, other)])
        except Exception as e:
            try:
                msg = str(e)[:300]
            except Exception:
                msg = ""
            chan.send(["e", type(e).__name__[:80], msg])


def answer(req, handles, other):
    op, h = req[0], handles[req[1]]
    if op == "call":
        args, kwargs = req[2], dict(req[3])
        mutable = [i for i, a in enumerate(args) if type(a) in (list, dict, set, bytearray)]
        before = {i: enc(args[i], other) for i in mutable}
        value = enc(h(*args, **kwargs), other)
        # in-place changes to list/dict/set arguments go back, so in-place solutions can be tested
        after = [[i, enc(args[i], other)] for i in mutable]
        return value, [m for m in after if m[1] != before[m[0]]]
    if op == "getattr":
        return enc(getattr(h, req[2]), other), []
    if op == "iter":
        return enc(iter(h), other), []
    if op == "next":
        return enc(next(h), other), []
    raise ValueError("unknown request")


# -- the tests' process ------------------------------------------------------------------------

def run_tests(spec, chan_fds, env):
    """Build the tests' namespace (trusted prompt code, then proxies for the program's names) and run
    the test code in it; returns normally only if the test code did."""
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["tests.py"]  # sys.path has no work dir: nothing the program writes is importable here

    class RemoteError(RuntimeError):
        pass

    def handle(v):
        if type(v) is not list or len(v) != 2 or type(v[0]) is not int:
            raise ValueError("malformed data")
        return Remote(v[0], str(v[1]))

    chan = Channel(chan_fds[0], chan_fds[1], revive(handle))
    Remote = remote_class(rpc_client(chan, RemoteError))
    ns = tests_namespace(spec, chan, RemoteError)
    exec(compile(spec["tests"], "tests.py", "exec"), ns)


def rpc_client(chan, RemoteError):
    """One request to the program's process; its reply as data, or its exception raised here (a
    builtin exception type by name, anything else as RemoteError)."""
    import builtins

    def rpc(*req):
        chan.send(list(req))
        r = chan.recv()
        if r is None:
            raise RemoteError("the solution's process ended before the tests finished")
        if type(r) is not list or len(r) != 3:
            raise RemoteError("malformed reply")
        if r[0] == "v":
            return r[1], r[2]
        exc = getattr(builtins, str(r[1]), None)
        if isinstance(exc, type) and issubclass(exc, Exception):
            try:
                err = exc(str(r[2]))
            except Exception:
                err = RemoteError("%s: %s" % (r[1], r[2]))
        else:
            err = RemoteError("%s: %s" % (r[1], r[2]))
        raise err
    return rpc


def remote_class(rpc):
    """The proxy of an object in the program's process: it can be called, iterated or asked for
    attributes, never compared or truth-tested."""

    def refuse(x):
        if isinstance(x, Remote):
            return {"h": [object.__getattribute__(x, "_h"), ""]}
        raise TypeError("cannot pass a %s to the solution's process: only plain data" % type(x).__name__)

    def not_data(self, *a):
        raise TypeError("the solution gave a non-data object (%s): it can be called, iterated or asked "
                        "for attributes, not compared or tested" % object.__getattribute__(self, "_what"))

    class Remote:
        __slots__ = ("_h", "_what")

        def __init__(self, h, what):
            object.__setattr__(self, "_h", h)
            object.__setattr__(self, "_what", what)

        def __call__(self, *args, **kwargs):
            value, changed = rpc("call", self._h, [enc(a, refuse) for a in args],
                                 [[k, enc(v, refuse)] for k, v in kwargs.items()])
            for i, new in changed:
                old = args[i] if type(i) is int and 0 <= i < len(args) else None
                if type(old) is type(new) and type(old) in (list, bytearray):
                    old[:] = new
                elif type(old) is type(new) and type(old) in (dict, set):
                    old.clear()
                    old.update(new)
            return value

        def __getattr__(self, name):
            if name.startswith("__") and name not in ("__name__", "__qualname__", "__doc__"):
                raise AttributeError(name)
            return rpc("getattr", self._h, name)[0]

        def __iter__(self):
            return rpc("iter", self._h)[0]

        def __next__(self):
            return rpc("next", self._h)[0]

        def __repr__(self):
            return "<solution %s>" % self._what

        __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __len__ = not_data
        __hash__ = object.__hash__

    return Remote


def tests_namespace(spec, chan, RemoteError):
    """The trusted prompt code (run while the program's top level runs), then the program's names."""
    import builtins

    ns = {"__name__": "__main__", "__builtins__": builtins}
    if spec["trusted"]:  # while the program's top level runs
        exec(compile(spec["trusted"], "prompt_code.py", "exec"), ns)
    names = chan.recv()
    if type(names) is not list:
        raise RemoteError("the solution's process ended before the tests started")
    entry = spec["entry"]
    for name, value in names:
        # the entry point always comes from the solution; other names only where the trusted code
        # and the builtins have none (a solution's own `abs` or `poly` must not change the tests)
        if name == entry or (name not in ns and not hasattr(builtins, name)):
            ns[name] = value
    return ns

