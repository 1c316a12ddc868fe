"""Device backends. Each is one module found by device type name and imported lazily."""
