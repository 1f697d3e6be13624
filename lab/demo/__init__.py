"""`afl demo`: real federations on loopback (daemons or Flower)."""
