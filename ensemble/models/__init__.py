"""The three scorers and the blender. Each module trains, saves in its native format, and loads
a scorer for serving; heavy frameworks are imported inside functions only."""
