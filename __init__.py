"""This folder is a compcomm checkout, not the package: the package is compcomm/ inside it.

Python takes a folder for a package when it is named like one, so from the folder above a
checkout named `compcomm`, `import compcomm` would find this folder first and give an empty
namespace package instead of the installed one. This file hands that import over to the real
package (with `backends/` as `compcomm.backends`, as the install maps it), so it works from there
too.
"""

import importlib.util
import os
import sys

if __name__ == "compcomm":  # under another name (a test runner walking the folder) it is just this docstring
    _root = os.path.dirname(os.path.abspath(__file__))
    _spec = importlib.util.spec_from_file_location(
        "compcomm",
        os.path.join(_root, "compcomm", "__init__.py"),
        submodule_search_locations=[os.path.join(_root, "compcomm"), _root],
    )
    assert _spec is not None and _spec.loader is not None
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["compcomm"] = _package  # the import system returns what sys.modules holds once this ran
    _spec.loader.exec_module(_package)
