"""The process a submitted notebook is graded in, and the process each of its answers is called in.

The autograder (``course_grader.py``) starts the submission's Jupyter kernel
through :func:`kernel_argv`.  Before ipykernel starts, and so before any of
the notebook's code runs, :func:`launch`:

1. caps the process's memory (``RLIMIT_AS``; its children inherit the cap);
2. connects to the grader's socket and starts a thread that waits there for
   the grader (:func:`_serve`);
3. installs an audit hook (:func:`_make_hook`; :func:`sys.addaudithook`: it
   cannot be removed).  From then on, in the kernel and in every process
   forked from it, code that is not this module's:

   * reads nothing under the grader's checkout (but the Python installation
     in it), the gradebook, the other submissions and their notebooks, or
     another process's ``/proc`` entries, and writes nothing outside the
     submission's own folder (``PermissionError``);
   * starts no process, connects, binds or sends on no socket, signals no
     other process, raises no resource limit, lists no object of the
     interpreter (``gc.get_objects`` and its kin, ``sys._current_frames``),
     and reads or rewrites no code or default of this module's functions;
   * in an answer's process, moreover, sets no profile or trace function and
     rewrites no function's ``__code__`` or defaults.

Once the notebook has run, the grader asks the thread, once per exercise,
for a process of its own for the answer: the thread forks the kernel
(:func:`_make_child`).  The child keeps the notebook's namespace, closes
every file the kernel had open, connects to the grader anew (the grader
checks, by the socket's peer credentials, that it is the kernel's child and
not the kernel), and receives the code the exercise refuses.  Before anything
of the notebook runs in it again, it makes that code unrunnable: every
function whose code lies there gets a ``__code__`` that raises
(:func:`_refuser`), so the refusal reaches it under every name, in every
default argument, closure and wrapper and on every thread; and a profile
function (:func:`_profile`), set for good on its thread and on every thread
:mod:`threading` starts there (the CUDA simulator's), refuses code of those
files that runs anyway (a function rebuilt from a saved code object) and a
thread started outside :mod:`threading`'s watch.  Then it serves the grader: it unpickles the inputs of each call
(:mod:`_wire`), calls the answer, and sends back only its results, encoded
as data; a call into refused code is reported by name.  The child exits
when the exercise is done; the kernel is left as it was for the next one.

The functions on that path take what they use (the modules, the builtins,
the other functions) as default arguments bound when this file is loaded,
before any submission runs, so that a notebook that replaces a module's
function, a builtin or one of this module's globals changes none of it.

What no Python process can promise: C code a submission reaches through
``ctypes``, or a submission that studies this module and walks up to its
frames, can undo any rule above.  Grade in an account or container that
holds nothing else; the grade itself is safe in any case, since the
reference and the comparison never run in the submission's processes.
"""

from __future__ import annotations

import builtins as _builtins_module

# a copy of the builtins taken when this file is loaded: a notebook that replaces ``builtins.len`` changes nothing here
__builtins__ = dict(_builtins_module.__dict__)

import _socket  # noqa: E402  (the C socket type: a notebook cannot replace its methods)
import _thread  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402

CONFIG = "COURSE_SANDBOX"  # the environment variable that carries the configuration (JSON) to the kernel
WATCHED_PROCESS = frozenset(("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                             "os.forkpty", "pty.spawn", "os.startfile"))
WATCHED_NETWORK = frozenset(("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"))
WATCHED_INTROSPECTION = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"))
WATCHED_LIMITS = frozenset(("resource.setrlimit", "resource.prlimit"))
WATCHED_SIGNALS = frozenset(("os.kill", "os.killpg", "signal.pthread_kill"))
WATCHED_TRACING = frozenset(("sys.setprofile", "sys.settrace"))
WATCHED_READ = frozenset(("os.listdir", "os.scandir", "os.chdir", "glob.glob"))
WATCHED_WRITE = frozenset(("os.mkdir", "os.rmdir", "os.remove", "os.truncate", "os.chmod", "os.chown", "os.utime",
                           "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "os.mkfifo", "os.mknod",
                           "shutil.rmtree", "shutil.make_archive", "shutil.unpack_archive", "tempfile.mkstemp",
                           "tempfile.mkdtemp"))
WATCHED_BOTH_WRITTEN = frozenset(("os.rename", "shutil.move"))  # (src, dst): both change
WATCHED_COPY = frozenset(("shutil.copyfile", "shutil.copymode", "shutil.copystat", "os.link", "os.symlink"))  # src read
WATCHED_ATTRIBUTES = frozenset(("object.__getattr__", "object.__setattr__"))
WATCHED = (WATCHED_PROCESS | WATCHED_NETWORK | WATCHED_INTROSPECTION | WATCHED_LIMITS | WATCHED_SIGNALS
           | WATCHED_TRACING | WATCHED_READ | WATCHED_WRITE | WATCHED_BOTH_WRITTEN | WATCHED_COPY | WATCHED_ATTRIBUTES
           | {"open"})
FUNCTION_SLOTS = frozenset(("__code__", "__defaults__", "__kwdefaults__"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Refused(AssertionError):
    """A call into code the exercise refuses, raised in the answer's process."""


def kernel_argv(python: str) -> list[str]:
    """The kernel's command: this file run by ``python`` (:func:`launch`), then ipykernel, with nothing of it in ``__main__``."""
    here = os.path.abspath(__file__)
    code = (f"exec(compile(open({here!r}, 'rb').read(), {here!r}, 'exec'), {{'__name__': 'course_sandbox_kernel'}})\n"
            "from ipykernel.kernelapp import launch_new_instance\nlaunch_new_instance()\n")
    return [python, "-c", code, "-f", "{connection_file}"]


def config(socket: str, own: str, deny: list[str], allow: list[str], memory: int, wire: str, course: str) -> str:
    """The configuration :func:`launch` reads, as the JSON text of the :data:`CONFIG` variable."""
    return json.dumps({"socket": socket, "own": own, "deny": deny, "allow": allow, "memory": memory,
                       "wire": wire, "course": course})


def _private(path: str, name: str) -> dict:
    """The namespace of the Python file ``path``, run as module ``name`` and then taken out of ``sys.modules``.

    A notebook cannot import it: only this module holds it.
    """
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module  # while it runs: dataclasses look their module up there
    try:
        with open(path, "rb") as f:
            exec(compile(f.read(), path, "exec"), module.__dict__)  # noqa: S102 -- the grader's own file, read first
    finally:
        del sys.modules[name]
    return module.__dict__


def _under(path: str, roots) -> str | None:
    """The longest of ``roots`` that holds ``path`` (both real paths), or None."""
    best = None
    for root in roots:
        if (path == root or path.startswith(root + os.sep) or root == os.sep) and (best is None or len(root) > len(best)):
            best = root
    return best


def _code_objects(namespace: dict) -> frozenset:
    """Every code object of the functions defined in ``namespace``, nested ones included."""
    out, todo = set(), [v.__code__ for v in namespace.values() if isinstance(v, types.FunctionType)]
    while todo:
        code = todo.pop()
        if code not in out:
            out.add(code)
            todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(out)


def _make_hook(own: str, deny: tuple, allow: tuple, kernel_pid: int, ours: frozenset, guarded: frozenset):
    """The audit hook of the submission's processes (the module docstring lists what it refuses).

    ``ours``: the code objects of this module, whose calls pass (the caller
    frame's code decides); ``guarded``: the ids of this module's functions,
    whose code and defaults no one else reads or rewrites.  A thread that
    :mod:`threading` starts in an answer's process sets its profile function
    (ours) before it runs anything: that one call passes.
    """
    getframe, getpid, realpath, fspath, fsdecode = sys._getframe, os.getpid, os.path.realpath, os.fspath, os.fsdecode
    getprofile, thread_start = sys.getprofile, threading.Thread._bootstrap_inner.__code__
    own = realpath(own)

    def refuse(what):
        raise PermissionError(f"the grader's sandbox refuses {what}: a graded notebook works in its own folder, "
                              "starts no process and reaches nothing of the grader's")

    def readable(path):
        real = realpath(path)
        parts = real.split(os.sep)
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != str(getpid()):
            return False  # another process's memory, environment or files
        where = _under(real, (own,) + allow + deny)
        return where is None or where == own or where in allow

    def writable(path):
        real = realpath(path)
        return real == os.devnull or _under(real, (own,)) == own

    def path_of(value):
        if isinstance(value, int) or value is None:
            return None
        try:
            value = fspath(value)
        except TypeError:
            return None
        return fsdecode(value)

    def hook(event, args):
        if event not in WATCHED:
            return
        if event in WATCHED_ATTRIBUTES:
            if args[1] not in FUNCTION_SLOTS:
                return
            if getframe(1).f_code in ours:
                return
            if id(args[0]) in guarded:
                refuse(f"access to {args[1]} of the grader's own functions")
            if event == "object.__setattr__" and getpid() != kernel_pid:
                refuse(f"rewriting a function's {args[1]} while an answer is graded")
            return
        caller = getframe(1).f_code
        if caller in ours:
            return
        if event == "open":
            path = path_of(args[0])
            if path is None:
                return
            mode, flags = args[1], args[2] if len(args) > 2 else 0
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
            if not readable(path) or (write and not writable(path)):
                refuse(f"opening {path}" + (" to write" if write else ""))
        elif event in WATCHED_READ:
            path = path_of(args[0]) if args else None
            if path is not None and not readable(path):
                refuse(f"{event} of {path}")
        elif event in WATCHED_COPY:
            source, target = path_of(args[0]), path_of(args[1])
            if event != "os.symlink" and source is not None and not readable(source):
                refuse(f"{event} of {source}")  # a link resolves where it points: only its own place is checked
            if target is not None and not writable(target):
                refuse(f"{event} into {target}")
        elif event in WATCHED_WRITE or event in WATCHED_BOTH_WRITTEN:
            for value in args[:2] if event in WATCHED_BOTH_WRITTEN else args[:1]:
                path = path_of(value)
                if path is not None and not writable(path):
                    refuse(f"{event} on {path}")
        elif event in WATCHED_SIGNALS:
            if args and args[0] != getpid():
                refuse("signalling another process")
        elif event in WATCHED_TRACING:
            new_thread = event == "sys.setprofile" and caller is thread_start and getprofile() is None
            if getpid() != kernel_pid and not new_thread:
                refuse(f"{event} while an answer is graded")
        elif event in WATCHED_PROCESS:
            refuse("starting a process")
        elif event in WATCHED_NETWORK:
            refuse("network and socket connections")
        elif event in WATCHED_INTROSPECTION:
            refuse(f"{event}")
        elif event in WATCHED_LIMITS:
            refuse("changing the resource limits")

    return hook


# ---------------------------------------------------------------------------
# in the answer's process: the refused code made unrunnable
# ---------------------------------------------------------------------------


def _matches(code, files, functions, function_files, allowed):
    """Whether ``code`` lies in the refused code: in ``files``, or in a function of ``functions``; ``allowed`` wins.

    The same rule as ``_course.Refusal.refuses``, written without a global or
    a builtin: the profile function calls it with empty builtins.
    """
    file = code.co_filename
    whole = file in files
    if not whole and file not in function_files:
        return False
    name = code.co_qualname
    hit = whole
    while True:
        if (file, name) in allowed:
            return False
        if (file, name) in functions:
            hit = True
        cut = name.rfind(".")
        if cut < 0:
            return hit
        name = name[:cut]


def _profile(frame, event, arg, matches=None, rules=None, latch=None, refused=None, modules=None, start=None,
             thread_start=None, threading_module=None, name=None, me=None):
    """The answer's profile function (made with empty builtins: it reads only its defaults).

    A thread passes only when :mod:`threading` starts it with this very
    function as the profile function it will set (``name``: what a refusal
    of any other calls the thread).
    """
    if event == "call":
        code = frame.f_code
        if matches(code, *rules):
            name = modules.get(code.co_filename, code.co_filename) + "." + code.co_qualname
            latch.append(name)
            raise refused(name)
    elif event == "c_call" and arg is start:
        if not (frame.f_code is thread_start and threading_module._profile_hook is me[0]):
            latch.append(name)
            raise refused(name)


_REFUSER = '''
def _outer():
{cells}
    def refused(*args, **kwargs):
{uses}
        "@latch".append("@name")
        raise "@error".__call__("@name")
    return refused
'''


def _refuser(code, name: str, latch: list, error: type, cache: dict, compile=compile, CodeType=types.CodeType):
    """A ``__code__`` for the function whose code is ``code``: it records ``name`` in ``latch`` and raises ``error(name)``.

    It has as many free variables as ``code`` (a closure keeps its cells), so
    it can replace ``code`` on the function object itself: every binding of
    the function then refuses.
    """
    n = len(code.co_freevars)
    template = cache.get(n)
    if template is None:
        names = [f"_cell{i}" for i in range(n)]
        source = _REFUSER.format(cells="".join(f"    {c} = None\n" for c in names) or "    pass\n",
                                 uses="".join(f"        {c}\n" for c in names))
        outer = compile(source, "<refused>", "exec", dont_inherit=True)
        template = next(c for c in next(c for c in outer.co_consts if isinstance(c, CodeType)).co_consts
                        if isinstance(c, CodeType))
        cache[n] = template
    marks = {"@latch": latch, "@name": name, "@error": error}
    return template.replace(co_consts=tuple(marks.get(c, c) if isinstance(c, str) else c for c in template.co_consts),
                            co_name=code.co_name, co_qualname=code.co_qualname)


def _read_exercise(conn, len=len, bytes=bytes, int=int, frozenset=frozenset, tuple=tuple):
    """The exercise's parameters from the grader, in a line format read with ``bytes`` and ``str`` methods only."""
    data = b""
    while len(data) < 8:
        data += conn.recv(8 - len(data))
    size, body = int.from_bytes(data, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the grader closed the connection")
        body += chunk
    lines = bytes(body).decode("utf-8").split("\n")
    head, sections, current = lines[:3], {"files": [], "functions": [], "allowed": [], "modules": []}, None
    for line in lines[3:]:
        if line.startswith("[") and line.endswith("]"):
            current = sections[line[1:-1]]
        elif line and current is not None:
            current.append(tuple(line.split("\t")) if "\t" in line else line)
    files = frozenset(sections["files"])
    functions = frozenset(sections["functions"])
    allowed = frozenset(sections["allowed"])
    modules = {}
    for file, module in sections["modules"]:
        modules[file] = module
    function_files = frozenset(f for f, _ in functions) | frozenset(f for f, _ in allowed)
    return head[1], head[2] == "kernel", (files, functions, function_files, allowed), modules


def _make_child(cfg: dict, wire: dict, course: dict):
    """The function the kernel's forked child runs (it never returns): the refusal set up, then the answer served."""
    maxfd = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096

    def child(path=cfg["socket"], closerange=os.closerange, os_open=os.open, dup2=os.dup2, getpid=os.getpid,
              exit=os._exit, maxfd=maxfd, devnull=os.devnull, rdwr=os.O_RDWR, sys=sys, io_type=io.StringIO,
              Socket=_socket.socket, unix=_socket.AF_UNIX, stream=_socket.SOCK_STREAM, get_objects=gc.get_objects,
              FunctionType=types.FunctionType, type=type, setprofile=sys.setprofile, frames=sys._current_frames,
              threading_module=threading, thread_start=threading.Thread.start.__code__, start=_thread.start_new_thread,
              profile_code=_profile.__code__, matches=_matches, refuser=_refuser, read=_read_exercise,
              answers=_serve_answers, wire=wire, course=course, Refused=Refused, len=len, BaseException=BaseException,
              thread_name=course["THREAD"]):
        try:
            closerange(3, maxfd)
            null = os_open(devnull, rdwr)
            for fd in (0, 1, 2):
                dup2(null, fd)
            sys.stdout = sys.stderr = io_type()
            conn = Socket(unix, stream)
            conn.connect(path)
            conn.sendall(b"C" + getpid().to_bytes(8, "big"))
            name, kernel, rules, modules = read(conn)
            latch, cache = [], {}
            for obj in get_objects():
                if type(obj) is FunctionType:
                    code = obj.__code__
                    if matches(code, *rules):
                        obj.__code__ = refuser(code, modules.get(code.co_filename, code.co_filename) + "."
                                               + code.co_qualname, latch, Refused, cache)
            me = [None]
            profile = FunctionType(profile_code, {"__builtins__": {}}, "profile",
                                   (matches, rules, latch, Refused, modules, start, thread_start, threading_module,
                                    thread_name, me))
            me[0] = profile
            threading_module._profile_hook = profile
            setprofile(profile)
            alone = len(frames()) == 1
        except BaseException:
            exit(3)
        try:
            answers(conn, name, kernel, latch, alone, wire, course)
        finally:
            exit(0)

    return child


def _make_serve(sock, child):
    """The kernel's thread: one forked child per ``b"f"`` from the grader, its pid sent back; ``b"q"`` ends it."""
    def serve(recv=sock.recv, sendall=sock.sendall, fork=os.fork, child=child, waitpid=os.waitpid,
              nohang=os.WNOHANG, OSError=OSError):
        while True:
            try:
                command = recv(1)
            except OSError:
                return
            if command != b"f":
                return
            try:
                while waitpid(-1, nohang)[0]:
                    pass  # the children of earlier exercises, done
            except OSError:
                pass
            pid = fork()
            if pid == 0:
                child()
            sendall(pid.to_bytes(8, "big"))

    return serve


def _serve_answers(conn, name, kernel, latch, alone, wire, course):
    """The grader's calls of the answer ``name`` of the notebook, in the answer's own process (refusal already set)."""
    send, recv, encode = wire["send"], wire["recv"], wire["encode"]
    if not alone:
        send(conn, {"op": "error", "message": "the notebook left a thread running in the grader's process, which "
                                             "an answer's process does not allow"})
        return
    try:
        namespace = sys.modules["IPython"].get_ipython().user_ns
        answer = namespace[name]
    except KeyError:
        send(conn, {"op": "missing"})
        return
    except Exception as err:  # no IPython kernel: nothing to grade
        send(conn, {"op": "error", "message": f"{type(err).__name__}: {err}"})
        return
    if not callable(answer):
        buffers: list = []
        try:
            tree = encode(answer, buffers)
        except BaseException as err:  # noqa: BLE001 -- whatever the value's code raised is the student's error
            send(conn, _raised(err, latch))
            return
        send(conn, {"op": "value", "value": tree}, buffers)
        return
    send(conn, {"op": "callable"})
    import numpy as np

    def ask(number, args, kwargs):
        buffers: list = []
        send(conn, {"op": "callback", "number": number, "args": encode(list(args), buffers),
                    "kwargs": encode(dict(kwargs), buffers)}, buffers)
        header, data = recv(conn)
        if header.get("op") == "callback-result":
            return wire["pickle"].loads(data[0])
        raise _exception(header.get("type", "RuntimeError"), header.get("message", ""))

    while True:
        header, data = recv(conn)
        if header.get("op") != "call":
            return
        try:
            args, kwargs = wire["loads_inputs"](data[0], ask)
        except BaseException as err:  # noqa: BLE001
            send(conn, {"op": "error", "message": f"the inputs could not be read here: {type(err).__name__}: {err}"})
            return
        leaves = wire["array_leaves"]((args, kwargs))
        before = [a.copy() for a in leaves]
        del latch[:]
        launches: list = []
        previous = np.seterr(**header.get("errstate", {}))
        interval = sys.getswitchinterval()
        sys.setswitchinterval(header.get("switchinterval", interval))
        try:
            if kernel:
                with course["counted_launches"](launches):
                    out = answer(*args, **kwargs)
            else:
                out = answer(*args, **kwargs)
            buffers = []
            reply = {"op": "result", "value": encode(out, buffers), "launches": len(launches)}
            changed = [[i, encode(a, buffers)] for i, (a, b) in enumerate(zip(leaves, before))
                       if a.shape != b.shape or not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")]
            reply["changed"] = changed
        except BaseException as err:  # noqa: BLE001 -- the answer's error, reported as such
            reply, buffers = _raised(err, latch), []
        finally:
            np.seterr(**previous)
            sys.setswitchinterval(interval)
        if latch:
            reply, buffers = {"op": "refused", "names": list(dict.fromkeys(latch))}, []
        send(conn, reply, buffers)


def _raised(err: BaseException, latch: list) -> dict:
    """The reply for an error the answer raised: its type, the builtin types it derives from, its message."""
    bases = [t.__name__ for t in type(err).__mro__ if isinstance(__builtins__.get(t.__name__), type)
             and issubclass(t, BaseException) and __builtins__[t.__name__] is t]
    try:
        message = str(err)
    except BaseException:  # noqa: BLE001
        message = "(its message could not be read)"
    return {"op": "raised", "type": type(err).__name__, "bases": bases, "message": message[:20000],
            "refused": list(latch)}


def _exception(name: str, message: str) -> BaseException:
    error = __builtins__.get(name)
    if isinstance(error, type) and issubclass(error, Exception):
        return error(message)
    return RuntimeError(f"{name}: {message}")


# ---------------------------------------------------------------------------
# the kernel's start
# ---------------------------------------------------------------------------


def launch() -> None:
    """Set the kernel up (the module docstring says what), then return for ipykernel to start."""
    cfg = json.loads(os.environ.pop(CONFIG))
    if cfg.get("memory"):
        resource.setrlimit(resource.RLIMIT_AS, (cfg["memory"], cfg["memory"]))
    wire = _private(cfg["wire"], "_course_wire")
    course = _private(cfg["course"], "_course_private")
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    sock.connect(cfg["socket"])
    sock.sendall(b"K" + os.getpid().to_bytes(8, "big"))
    child = _make_child(cfg, wire, course)
    serve = _make_serve(sock, child)
    namespace = globals()
    ours = _code_objects(namespace)
    guarded = frozenset(id(f) for f in [*namespace.values(), child, serve] if isinstance(f, types.FunctionType))
    allow = tuple(os.path.realpath(p) for p in cfg["allow"])
    deny = tuple(os.path.realpath(p) for p in cfg["deny"])
    hook = _make_hook(cfg["own"], deny, allow, os.getpid(), ours, guarded)
    _thread.start_new_thread(serve, ())
    sys.addaudithook(hook)
    # the checkout's folders (this file's among them) leave the import path: the submission's copy is what it imports
    sys.path[:] = [p for p in sys.path if not _under(os.path.realpath(p or "."), deny) or _under(
        os.path.realpath(p or "."), (os.path.realpath(cfg["own"]),) + allow)]


if __name__ == "course_sandbox_kernel":
    launch()
