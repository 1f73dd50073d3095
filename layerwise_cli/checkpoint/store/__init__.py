"""Object stores and HTTPS servers as a source (obstore).

Objects pinned to their ETags, a checkpoint's headers read by range.
"""
