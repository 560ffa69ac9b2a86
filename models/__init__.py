"""draftsmith.models: the floor below draftsmith.decode and draftsmith.train."""
from draftsmith.models import attention  # noqa: F401  (registers the `grouped` attention implementation)
