"""The process ckptconv runs in: how many cores it keeps busy (``cores``), holding signals back while C++
calls into Python (``signals``), pausing the garbage collector while a tree is built (``collector``), and the
optional extras installed (``extras``: torch).
"""
