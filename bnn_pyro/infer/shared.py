"""What the tools built on the engines (``bnn_pyro.tools``: curves, distillation) share with them: the data view, the
config cleaner, the thread scope and the compiled log joint. A public home inside ``infer/`` so that no module outside
it reaches into the engines' private modules; the engines themselves import these from where they are defined."""

from bnn_pyro.infer._common import clean_config, torch_threads
from bnn_pyro.infer._logjoint import LogJoint, build, is_identity
from bnn_pyro.infer.training_data import Data

__all__ = ["Data", "clean_config", "torch_threads", "LogJoint", "build", "is_identity"]
