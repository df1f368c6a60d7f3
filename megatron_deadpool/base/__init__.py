"""Foundations: errors, configuration, the fault schedule, sections, what the launcher
tells a worker, and pure planning. Imports nothing else of the package."""
