"""`lorad serve`: start-up recovery, the socket server and its handlers, notifications, the clean stop."""
