"""nn.Module wrappers: presets, input checks, component logging. One objective per module."""
