"""What a process of ours needs about itself, beside the pure library: its log lines and
progress, and children that must not outlive it. Not pure: the one room of echo/ that touches
the process (the tasks' environment servers and streams/ use it, which sit below workers/).

logs.py         log lines and progress
lifeline.py     processes that must not outlive their parent
"""
