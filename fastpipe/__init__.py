"""fastpipe: pipeline-parallel training for PyTorch.

Importing this package runs nothing: the native extension and the subpackages
load when first used.
"""

from fastpipe._version import __version__

__all__ = ["__version__"]
