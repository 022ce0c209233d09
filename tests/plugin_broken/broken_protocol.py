"""A plugin that fails as it is imported, as one with a missing dependency would."""
import a_module_that_is_not_installed  # noqa: F401
