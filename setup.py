"""Packaging beyond pyproject.toml: fastrlhf-patch.pth (fastrlhf_hook's start-up line) at the top of
site-packages, from a wheel and from an editable install alike."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = Path(__file__).parent / "fastrlhf_hook" / "fastrlhf-patch.pth"


class build_py_with_pth(build_py):
    """build_py, then fastrlhf-patch.pth beside the packages. A wheel puts build_lib's top level in
    site-packages. An editable install (setuptools >= 64, PEP 660) leaves build_lib out of its wheel and
    packs the install command's install_lib, the unpacked wheel, as it is: the file goes there."""

    def run(self):
        super().run()
        top = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(str(PTH), str(Path(top, PTH.name)), preserve_mode=False)


setup(cmdclass={"build_py": build_py_with_pth})
