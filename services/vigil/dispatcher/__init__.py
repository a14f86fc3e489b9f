"""The dispatcher: relays the outbox to each user's channel, paced per user."""
