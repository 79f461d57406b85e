"""decider.engine.model.cxx_runtime: which library answers C++ runtime calls in libstdc++'s place.

The real case, with two tiny C++ libraries built here: `libuser.so` linked against a plain
`libprovider.so`, then run beside a provider built with `-static-libstdc++` (what a toolchain did to
libggml on the GPU check's machine), and beside one built with `-Wl,--exclude-libs,ALL` too (the
CUDA image's flags)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from decider.engine.model import cxx_runtime, load_probe
from decider.errors import LoadCrashedError
from decider.settings import Settings

PROVIDER = """#include <locale>
#include <sstream>
extern "C" int provider_digits(int n) {
    std::ostringstream s; s.imbue(std::locale::classic()); s << n; return (int)s.str().size();
}
"""
USER = """#include <locale>
#include <sstream>
extern "C" int provider_digits(int n);
extern "C" int user_digits(int n) {
    std::ostringstream s; s.imbue(std::locale::classic()); s << n;
    return (int)s.str().size() + provider_digits(n);
}
"""
PROVIDERS = {
    "plain": [],
    "static": ["-static-libstdc++"],
    "static, exclude-libs": ["-static-libstdc++", "-Wl,--exclude-libs,ALL"],
}


@pytest.fixture(scope="module")
def user_libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """libuser.so beside each kind of libprovider.so, by kind."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("needs g++")
    root = tmp_path_factory.mktemp("cxx")
    (root / "provider.cpp").write_text(PROVIDER)
    (root / "user.cpp").write_text(USER)
    users = {}
    for kind, flags in PROVIDERS.items():
        directory = root / kind.replace(", ", "-")
        directory.mkdir()
        command = [compiler, "-shared", "-fPIC", "-O1", str(root / "provider.cpp"), *flags]
        subprocess.run([*command, "-o", str(directory / "libprovider.so")], check=True)
        users[kind] = directory / "libuser.so"
    plain = users["plain"].parent
    link = [compiler, "-shared", "-fPIC", "-O1", str(root / "user.cpp"), f"-L{plain}", "-lprovider"]
    subprocess.run([*link, "-Wl,-rpath,$ORIGIN", "-o", str(users["plain"])], check=True)
    for kind, user in users.items():
        if kind != "plain":
            shutil.copy(users["plain"], user)
    return users


def test_a_statically_linked_runtime_answers_the_calls_of_the_library_after_it(
    user_libraries: dict[str, Path],
) -> None:
    assert cxx_runtime.check([user_libraries["plain"]]).interpositions == ()
    (found,) = cxx_runtime.check([user_libraries["static"]]).interpositions
    assert (found.user, found.provider) == ("libuser.so", "libprovider.so") and found.symbols >= 5
    assert found.example.startswith("_Z")
    assert cxx_runtime.check([user_libraries["static, exclude-libs"]]).interpositions == ()
    assert cxx_runtime.main([str(user_libraries["static"])]) == 1
    assert cxx_runtime.main([str(user_libraries["static, exclude-libs"])]) == 0


def test_this_venv_s_llama_cpp_leaves_the_runtime_to_libstdcxx() -> None:
    libraries = cxx_runtime.llama_cpp_libraries()
    assert libraries[0].name.startswith("libllama")
    result = cxx_runtime.check(libraries)
    assert result.interpositions == () and result.unloaded == (), result.describe()


def test_the_linker_s_bindings_are_read_by_version_and_by_who_answers() -> None:
    text = "\n".join(
        [
            "  1:\tbinding file /l/libllama.so [0] to /l/libggml.so.0 [0]: normal symbol "
            "`_ZNSt6locale7classicEv' [GLIBCXX_3.4]",
            "  1:\tbinding file /l/libllama.so [0] to /l/libggml.so.0 [0]: normal symbol "
            "`_ZTVSt9basic_iosIcSt11char_traitsIcEE' [GLIBCXX_3.4]",
            "  1:\tbinding file /l/libllama.so [0] to /l/libggml.so.0 [0]: normal symbol "
            "`__cxa_throw' [CXXABI_1.3]",
            # answered by the runtime itself: fine
            "  1:\tbinding file /l/libllama.so [0] to /usr/lib/libstdc++.so.6 [0]: normal symbol "
            "`_ZNSt6locale7classicEv' [GLIBCXX_3.4]",
            # the runtime's own call to an inline member a library also emitted: the same code
            "  1:\tbinding file /usr/lib/libstdc++.so.6 [0] to /l/libllama.so [0]: normal symbol "
            "`_ZNKSt5ctypeIcE8do_widenEc' [GLIBCXX_3.4]",
            # a template the library instantiated itself: unversioned, not the runtime's
            "  1:\tbinding file /l/libllama.so [0] to /l/libggml.so.0 [0]: normal symbol "
            "`_ZNSt6vectorIiSaIiEE17_M_realloc_insertEv'",
            "  1:\tbinding file /l/libllama.so [0] to /l/libggml.so.0 [0]: normal symbol `ggml_init'",
        ]
    )
    (found,) = cxx_runtime.parse_bindings(text)
    assert found == cxx_runtime.Interposition("libllama.so", "libggml.so.0", 3, "_ZNSt6locale7classicEv")
    line = cxx_runtime.RuntimeCheck(
        (found,), (("/l/libggml-cuda.so", "libcuda.so.1: cannot open"),)
    ).describe()
    assert "libllama.so binds 3 C++ runtime symbols to libggml.so.0" in line and "--exclude-libs,ALL" in line
    assert line.endswith("(not loadable here: libggml-cuda.so)")
    assert (
        cxx_runtime.RuntimeCheck(()).describe()
        == "no library answers C++ runtime symbols in libstdc++'s place"
    )


def test_a_crashed_load_probe_names_the_runtime_copy_when_one_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_libraries: dict[str, Path]
) -> None:
    """The crash line carries the likely cause; without one (or if the check fails) it is unchanged."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    crash = ["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    settings = Settings.from_values({})
    static = user_libraries["static"]
    monkeypatch.setattr(cxx_runtime, "llama_cpp_libraries", lambda: [static])
    with pytest.raises(LoadCrashedError) as crashed:
        load_probe.check_load(model, settings, command=crash)
    assert "with SIGSEGV" in str(crashed.value)
    assert "likely cause: libuser.so binds" in str(crashed.value) and "libprovider.so" in str(crashed.value)
    monkeypatch.setattr(cxx_runtime, "llama_cpp_libraries", lambda: [user_libraries["plain"]])
    with pytest.raises(LoadCrashedError) as plain:
        load_probe.check_load(model, settings, command=crash)
    assert "likely cause" not in str(plain.value)

    def broken(*_args: object, **_kwargs: object) -> None:
        raise OSError("no such interpreter")

    monkeypatch.setattr(cxx_runtime, "check", broken)
    with pytest.raises(LoadCrashedError) as unchecked:
        load_probe.check_load(model, settings, command=crash)
    assert "likely cause" not in str(unchecked.value) and "with SIGSEGV" in str(unchecked.value)
