"""The daemon: a conductor (daemon.py) and the stages it runs each tick: watching the sources,
restarting, the flags loop, and the status it writes.
"""
