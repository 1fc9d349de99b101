"""A plugin whose own code fails while it is imported."""

raise RuntimeError("this plugin is broken on purpose")
