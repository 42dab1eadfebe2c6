"""The desktop app: the window's controllers, the engine thread's driver and its Qt-free engine side,
settings, start-up.

Qt lives here (and in ui/); the engine and the other capability rooms of app/ know nothing of it
(docs/design.md §1).
"""
