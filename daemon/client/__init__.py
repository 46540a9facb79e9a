"""The `lorad` command line: verbs over the socket, what they print, and the foreground commands."""
