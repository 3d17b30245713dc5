"""Support code that no lesson is about: finding the model, timing, the tiny test checkpoint."""
