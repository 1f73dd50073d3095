"""`watch`.

Keep servers or an in-process engine on the newest complete step of a run (local folder, URL prefix or Hub repo).
"""
