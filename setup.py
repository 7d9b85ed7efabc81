"""Builds the C++ CPU ops ahead of time; every other piece of metadata is in pyproject.toml.

One shared library per instruction-set variant of ``kernels/cpu/csrc/*.cpp``
(``kernels/cpu/variants.py`` names the variants and holds every compiler flag), each compiled in
a build folder of its own by ninja. The libraries land next to ``variants.py``: in the wheel, or
in the source tree for an editable install (``make setup``). At run time ``loader.py`` loads the
one the CPU supports best; nothing is compiled then. torch, pinned in ``[build-system]
requires``, provides the headers and the libraries to link against.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import warnings
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup

# pip's isolated build environment has torch but no numpy (nothing here needs it): torch's
# import warns about that on every build step.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

ROOT = Path(__file__).resolve().parent


def _variants() -> ModuleType:
    # Loaded by path: the corefleet package is not importable while it is being built.
    path = ROOT / "kernels" / "cpu" / "variants.py"
    spec = importlib.util.spec_from_file_location("_corefleet_cpu_variants", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses looks its module up while defining a class
    spec.loader.exec_module(module)
    return module


variants = _variants()
# The extension's last name (`_ops_avx2` of `corefleet.kernels.cpu._ops_avx2`) -> its library's
# file name without the suffix (`_ops_avx2_<digest>`). The digest is left out of the extension's
# name, which torch compiles into every object (-DTORCH_EXTENSION_NAME), so that ninja
# recompiles only what changed.
_LIBRARY_STEMS: dict[str, str] = {}


def _extensions() -> list[Extension]:
    # setuptools wants source paths relative to this file's folder.
    sources = [path.relative_to(ROOT).as_posix() for path in variants.sources()]
    extensions = []
    for variant in variants.variants_for(platform.machine()):
        name = f"{variants.LIBRARY_PREFIX}{variant.name}"
        _LIBRARY_STEMS[name] = variants.library_stem(variant)
        extensions.append(
            CppExtension(
                f"corefleet.kernels.cpu.{name}",
                sources,
                extra_compile_args=[*variants.COMMON_CFLAGS, *variant.cflags],
                extra_link_args=list(variants.LDFLAGS),
                # The ops use no Python API: no libtorch_python, no CPython ABI in the library.
                py_limited_api=True,
            )
        )
    return extensions


class BuildVariants(BuildExtension):
    """torch's BuildExtension with a build folder per variant (every variant compiles the same
    source files, whose objects and ninja files would otherwise overwrite each other), and the
    sources' digest in each library's file name."""

    def build_extension(self, ext: Extension) -> None:
        shared: str = self.build_temp  # type: ignore[has-type]
        self.build_temp = os.path.join(shared, ext.name.rsplit(".", 1)[-1])
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared

    def get_ext_filename(self, ext_name: str) -> str:
        # Asked with the full name and (for the linker's output) with the last part alone.
        filename: str = super().get_ext_filename(ext_name)
        stem = _LIBRARY_STEMS.get(ext_name.rsplit(".", 1)[-1])
        if stem is None:
            return filename
        folder, name = os.path.split(filename)
        return os.path.join(folder, stem + os.path.splitext(name)[1])

    def run(self) -> None:
        super().run()
        if self.inplace or getattr(self, "editable_mode", False):
            _remove_stale_libraries()


def _remove_stale_libraries() -> None:
    # A build into the source tree (editable install, `make kernels`) after csrc/ changed
    # leaves the libraries of the old sources behind: their names carry the old digest.
    current = {f"{variants.library_stem(v)}.so" for v in variants.variants_for(platform.machine())}
    for path in (ROOT / "kernels" / "cpu").glob(f"{variants.LIBRARY_PREFIX}*.so"):
        if path.name not in current:
            path.unlink()


setup(
    ext_modules=_extensions(),
    # `_ops_avx2_<digest>.so`, not a Python module's name: the loader opens it with
    # torch.ops.load_library.
    cmdclass={"build_ext": BuildVariants.with_options(no_python_abi_suffix=True)},
    # The libraries use no CPython ABI, so one wheel serves every CPython from 3.10.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
