"""A training run's steps.

Which exist, which are complete, which may be deleted, in a local folder or under a URL prefix.
"""
