"""Whether a llama.cpp library answers calls meant for the C++ runtime, as the dynamic linker sees it.

libllama is C++ (its tokenizer uses `std::regex`), and so are libggml and the backends. Each asks
the dynamic linker for libstdc++'s symbols, and the linker answers with the first library in the
asker's lookup scope that defines one: libllama lists libggml before libstdc++. A library that
linked C++ runtime code from a static archive (`-static-libstdc++`, or a toolchain whose
`libstdc++.so` is a linker script adding `libstdc++_nonshared.a`) and exports it therefore
answers libllama's calls with its private copy. Where that copy is not the runtime's own code,
libllama mixes the two (locale facets registered in one, looked up in the other) and crashes.
That is what the GPU check's machine showed: every model load died in `std::regex` inside
libllama's tokenizer, in a call that landed in a 1.5 MB libggml.so at libstdc++'s
`std::codecvt<char16_t, char, mbstate_t>::do_unshift` (docs/engine.md, "Running on a GPU").
Built here with `-static-libstdc++`, libggml.so exports that very symbol among 3,834 of the C++
runtime's, and libllama binds 69 of its references to them; with `-Wl,--exclude-libs,ALL` (the
image's CUDA flags) it binds none.

The check: a child process loads the libraries with `LD_BIND_NOW=1 LD_DEBUG=bindings`, and every
binding of a versioned C++ runtime symbol (`GLIBCXX_*`, `CXXABI_*`: a reference its library made
against libstdc++ when it was linked) to a library that is not libstdc++ is reported. Template
code the libraries instantiate themselves is unversioned and not counted, nor are libstdc++'s own
references to inline members that a library emitted too (every build has a few, such as
`std::ctype<char>::do_widen` answered by libllama: the same code, from the same headers).

    python -m decider.engine.model.cxx_runtime [LIBRARY ...]   # exit 1 when one is found
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# binding file /…/libllama.so [0] to /…/libggml.so.0 [0]: normal symbol `_ZNSt6locale7classicEv' [GLIBCXX_3.4]
BINDING = re.compile(
    r"binding file (?P<user>\S+) \[\d+\] to (?P<provider>\S+) \[\d+\]: \w+ symbol "
    r"`(?P<symbol>[^']+)' \[(?P<version>(?:GLIBCXX|CXXABI)_[\w.]+)\]"
)
RUNTIME_NAME = "libstdc++.so"
TIMEOUT_SECONDS = 60.0
# Loads each library given as JSON on argv, in order; prints those that did not load.
LOADER = (
    "import ctypes, json, sys\n"
    "for path in json.loads(sys.argv[1]):\n"
    "    try:\n"
    "        ctypes.CDLL(path)\n"
    "    except OSError as exc:\n"
    "        print(json.dumps([path, str(exc)]), flush=True)\n"
)


@dataclass(frozen=True)
class Interposition:
    """`provider` answered `symbols` of `user`'s references to the C++ runtime (file names)."""

    user: str
    provider: str
    symbols: int
    example: str


@dataclass(frozen=True)
class RuntimeCheck:
    interpositions: tuple[Interposition, ...]
    unloaded: tuple[tuple[str, str], ...] = ()  # (library, why) that could not be loaded here

    def describe(self) -> str:
        """One line for a log or a report."""
        if self.interpositions:
            found = "; ".join(
                f"{i.user} binds {i.symbols} C++ runtime symbols to {i.provider} (e.g. {i.example})"
                for i in self.interpositions
            )
            line = (
                f"{found}: a copy of libstdc++'s code linked from a static archive and exported; "
                "link with -Wl,--exclude-libs,ALL, or preload libstdc++.so.6"
            )
        else:
            line = "no library answers C++ runtime symbols in libstdc++'s place"
        if self.unloaded:
            line += " (not loadable here: " + ", ".join(Path(path).name for path, _ in self.unloaded) + ")"
        return line


def parse_bindings(text: str) -> tuple[Interposition, ...]:
    """The interpositions in the dynamic linker's `LD_DEBUG=bindings` output."""
    counts: Counter[tuple[str, str]] = Counter()
    examples: dict[tuple[str, str], str] = {}
    for match in BINDING.finditer(text):
        user, provider = Path(match["user"]).name, Path(match["provider"]).name
        if provider.startswith(RUNTIME_NAME) or user.startswith(RUNTIME_NAME):
            continue
        key = (user, provider)
        counts[key] += 1
        examples.setdefault(key, match["symbol"])
    return tuple(Interposition(*key, n, examples[key]) for key, n in counts.items())


def llama_cpp_libraries() -> list[Path]:
    """libllama (which brings libggml and libggml-base) and the backend modules beside it."""
    from decider.engine.model.ggml_backends import LIBLLAMA_NAMES, llama_cpp_lib_dir

    lib_dir = llama_cpp_lib_dir()
    libllama = [lib_dir / name for name in LIBLLAMA_NAMES if (lib_dir / name).is_file()][:1]
    modules = sorted(path for path in lib_dir.glob("libggml-*.so") if "ggml-base" not in path.name)
    return libllama + modules


def check(libraries: Sequence[Path] | None = None, *, timeout: float = TIMEOUT_SECONDS) -> RuntimeCheck:
    """Load `libraries` (default: llama.cpp's) in a child with every symbol bound at once, and
    report which of them answer C++ runtime symbols in libstdc++'s place."""
    paths = [str(path) for path in (llama_cpp_libraries() if libraries is None else libraries)]
    with tempfile.TemporaryDirectory(prefix="cxx-runtime-") as scratch:
        env = {**os.environ, "LD_BIND_NOW": "1", "LD_DEBUG": "bindings"}
        env["LD_DEBUG_OUTPUT"] = str(Path(scratch) / "ld")
        env.pop("LD_PRELOAD", None)  # what the libraries do by themselves
        done = subprocess.run(
            [sys.executable, "-c", LOADER, json.dumps(paths)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        text = "".join(path.read_text(errors="replace") for path in Path(scratch).glob("ld.*"))
    unloaded = tuple(tuple(json.loads(line)) for line in done.stdout.splitlines() if line.startswith("["))
    return RuntimeCheck(parse_bindings(text), unloaded)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("libraries", nargs="*", type=Path, help="default: libllama and the ggml backends")
    args = parser.parse_args(argv)
    result = check(args.libraries or None)
    print(result.describe())
    return 1 if result.interpositions else 0


if __name__ == "__main__":
    sys.exit(main())
