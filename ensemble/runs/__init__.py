"""Runs that use the whole library below them: training every model of a release (``training``) and the
README's figures from the committed result files (``readme_figures``)."""
