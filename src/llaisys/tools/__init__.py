"""Tools that sit above the models layer: the plugin conformance check runs ops and a model
on a plugin's device."""
